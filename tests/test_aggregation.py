"""Flower-free aggregation math (task/prototypes, task/weights, task/sampling) and the results'
statistics (report), on hand-computed numbers."""

import numpy as np
import pytest
import torch

from protofl.report import class_weighted_accuracy, personalized_stats, summarize
from protofl.task.losses import prototype_loss
from protofl.task.prototypes import aggregate_prototypes, sigmoid_discrepancy_weights
from protofl.task.robust import robust_average_layers, robust_mean, trimmed_mean
from protofl.task.sampling import client_seed, sample_partitions
from protofl.task import weights as weights_module
from protofl.task.weights import weighted_average

# two clients, three classes, 2-d features; nobody holds class 2 (client A's row is junk)
PROTOTYPES = np.array(
    [
        [[1.0, 0.0], [0.0, 2.0], [9.0, 9.0]],
        [[3.0, 2.0], [4.0, 0.0], [0.0, 0.0]],
    ],
    dtype=np.float32,
)
COUNTS = np.array([[3, 1, 0], [1, 3, 0]])


def test_fedproto_count_weighted_prototypes():
    global_prototypes, mask = aggregate_prototypes(PROTOTYPES, COUNTS, "count")
    # class 0: (3*[1,0] + 1*[3,2]) / 4 ; class 1: (1*[0,2] + 3*[4,0]) / 4
    np.testing.assert_allclose(global_prototypes, [[1.5, 0.5], [3.0, 0.5], [0.0, 0.0]])
    assert mask.tolist() == [True, True, False]
    assert global_prototypes.dtype == np.float32


def test_fedproto_uniform_prototypes():
    global_prototypes, mask = aggregate_prototypes(PROTOTYPES, COUNTS, "uniform")
    np.testing.assert_allclose(global_prototypes, [[2.0, 1.0], [2.0, 1.0], [0.0, 0.0]])
    assert mask.tolist() == [True, True, False]


def test_fedproto_class_held_by_one_client_is_that_clients_prototype():
    counts = np.array([[3, 0, 0], [1, 3, 0]])
    global_prototypes, _ = aggregate_prototypes(PROTOTYPES, counts, "count")
    np.testing.assert_allclose(global_prototypes[1], [4.0, 0.0])


def test_fedproto_rejects_unknown_weighting():
    with pytest.raises(ValueError, match="weighting"):
        aggregate_prototypes(PROTOTYPES, COUNTS, "median")


def test_prototype_loss_hand_computed():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    labels = torch.tensor([0, 2])
    prototypes = torch.tensor([[0.0, 0.0], [5.0, 5.0], [1.0, 1.0]])
    mask = torch.tensor([True, True, False])
    # sample 0: (1-0)^2 + (2-0)^2 = 5; sample 1 has no global prototype -> 0; / (2*2)
    assert prototype_loss(features, labels, prototypes, mask).item() == pytest.approx(1.25)


def test_weighted_average_hand_computed_and_keeps_dtypes():
    client_a = [np.array([1.0, 2.0], np.float32), np.array([2], np.int64)]
    client_b = [np.array([5.0, 6.0], np.float32), np.array([4], np.int64)]
    averaged = weighted_average([client_a, client_b], [1, 3])
    np.testing.assert_allclose(averaged[0], [4.0, 5.0])
    assert averaged[0].dtype == np.float32 and averaged[1].dtype == np.int64
    assert weighted_average([client_a, client_b], [1, 1])[1].tolist() == [3]


def test_weighted_sums_over_blocks_of_entries_are_each_rows_float64_sum(monkeypatch):
    """Arrays of 7 and 2 x 3 entries (a scalar, an empty one too) in blocks of 3 entries: each row of
    weights gives the float64 sum of the weighted models in each array's shape and dtype. The bound:
    a sum of 4 float64 products errs by at most 4 eps sum |w m|, and its rounding to float32 by
    float32's eps of the sum."""
    monkeypatch.setattr(weights_module, "COLUMNS", 3)
    rng = np.random.default_rng(0)
    models = [[rng.normal(size=7).astype(np.float32), rng.normal(size=(2, 3)), np.array(5 + k), np.zeros((0, 4))]
              for k in range(4)]
    weights = rng.normal(size=(3, 4))
    for row, sums in zip(weights, weights_module.weighted_sums(weights, models)):
        for index, got in enumerate(sums):
            want = sum(w * np.asarray(m[index], np.float64) for w, m in zip(row, models))
            assert got.shape == models[0][index].shape and got.dtype == models[0][index].dtype
            if got.dtype == np.int64:
                np.testing.assert_array_equal(got, want.astype(np.int64))
                continue
            scale = sum(abs(w) * np.abs(np.asarray(m[index], np.float64)) for w, m in zip(row, models))
            bound = 4 * np.finfo(np.float64).eps * scale + np.finfo(got.dtype).eps * np.abs(want)
            assert np.all(np.abs(got - want) <= bound)


def test_personalized_stats_hand_computed():
    stats = personalized_stats([9, 5, 0], [10, 10, 5])
    assert stats["accuracy"] == pytest.approx(14 / 25)
    assert stats["mean"] == pytest.approx((0.9 + 0.5 + 0.0) / 3)
    assert stats["std"] == pytest.approx(np.sqrt((0.4333333**2 + 0.0333333**2 + 0.4666667**2) / 3), rel=1e-5)
    assert stats["worst10"] == 0.0  # ceil(10 % of 3) = 1 client
    assert personalized_stats([9, 5, 3], [10, 10, 5])["min"] == 0.5


def test_worst10_averages_the_lowest_tenth():
    correct = list(range(20))  # accuracies 0.00 .. 0.95
    assert personalized_stats(correct, [20] * 20)["worst10"] == pytest.approx((0 + 1) / 20 / 2)


def test_pm_l_and_pm_v_weight_a_confusion_matrix_by_the_clients_classes():
    # balanced test set, 3 classes x 10 images; rows = true class, columns = predicted
    confusion = np.array([[9, 1, 0], [4, 5, 1], [0, 10, 0]])
    correct, tested = np.diag(confusion), confusion.sum(axis=1)
    train_counts = np.array([6, 2, 0])  # the client holds classes 0 and 1, three times more of 0
    # PM(L): (6*9 + 2*5) / (6*10 + 2*10) = 64 / 80
    assert class_weighted_accuracy(correct, tested, train_counts / train_counts.sum()) == pytest.approx(0.8)
    # PM(V): classes 0 and 1 equally: (9 + 5) / 20
    assert class_weighted_accuracy(correct, tested, train_counts > 0) == pytest.approx(0.7)
    # all classes equally: plain accuracy on the balanced set, 14 / 30
    assert class_weighted_accuracy(correct, tested, np.ones(3)) == pytest.approx(14 / 30)
    with pytest.raises(ValueError):
        class_weighted_accuracy(correct, np.array([10, 10, 0]), np.array([0, 0, 1]))


def test_summarize_final_best_last10_skip_unmeasured_rounds():
    rounds = [{"round": r, "acc": (None if r % 2 else r / 100)} for r in range(1, 31)]
    rounds[-1]["acc"] = 0.05  # round 30: worse than the best
    summary = summarize(rounds, "acc")
    assert summary["final"] == 0.05 and summary["final_round"] == 30
    assert summary["best"] == 0.28 and summary["best_round"] == 28
    measured = [r / 100 for r in range(12, 30, 2)] + [0.05]  # last 10 measured values
    assert summary["last10_mean"] == pytest.approx(np.mean(measured))
    assert summarize([{"round": 1, "acc": None}], "acc") is None


def test_sampling_is_seeded_by_seed_and_round_not_by_id_order():
    ids = list(range(20))
    first = sample_partitions(ids, 0.5, 2, seed=7, server_round=3)
    assert first == sample_partitions(list(reversed(ids)), 0.5, 2, seed=7, server_round=3)
    assert len(first) == 10 and len(set(first)) == 10 and set(first) <= set(ids)
    other_rounds = [sample_partitions(ids, 0.5, 2, seed=7, server_round=r) for r in range(4, 10)]
    assert any(s != first for s in other_rounds)
    assert sample_partitions(ids, 0.5, 2, seed=8, server_round=3) != first


def test_sampling_respects_min_clients_and_available_ids():
    assert len(sample_partitions([3, 5, 9], 0.1, 2, seed=0, server_round=1)) == 2
    assert sample_partitions([4], 0.5, 2, seed=0, server_round=1) == [4]


def test_client_seeds_differ_per_client_and_round():
    seeds = {client_seed(0, r, p) for r in range(1, 4) for p in range(5)}
    assert len(seeds) == 15
    assert client_seed(0, 1, 1) == client_seed(0, 1, 1)


# --- robust rules (task/robust) -----------------------------------------------------------------

STACK = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -1000.0]])  # the last row is the outlier


def test_coordinate_wise_median_and_trimmed_mean():
    np.testing.assert_allclose(robust_mean(STACK, [1, 1, 1, 1], "median"), [2.5, 15.0])
    # trim 0.25 of 4 = 1 value at each end, per coordinate: [2, 3] and [10, 20]
    np.testing.assert_allclose(robust_mean(STACK, [1, 1, 1, 1], "trimmed-mean", 0.25), [2.5, 15.0])
    np.testing.assert_allclose(robust_mean(STACK, [1, 1, 1, 1], "trimmed-mean", 0.0), STACK.mean(axis=0))
    np.testing.assert_allclose(trimmed_mean(STACK[:2], 0.49), STACK[:2].mean(axis=0))  # keeps at least one value
    np.testing.assert_allclose(robust_mean(STACK, [1, 1, 1, 5], "method"), (STACK[:3].sum(0) + 5 * STACK[3]) / 8)


def test_norm_clip_scales_each_deviation_to_the_median_norm():
    vectors = np.array([[3.0, 4.0], [0.0, 1.0], [0.0, -2.0]])  # deviation norms from 0: 5, 1, 2 -> median 2
    clipped = robust_mean(vectors, [1, 1, 2], "norm-clip", center=np.zeros(2))
    np.testing.assert_allclose(clipped, ([1.2, 1.6] + np.array([0.0, 1.0]) + 2 * np.array([0.0, -2.0])) / 4)
    # centre defaults to the coordinate-wise median [0, 1]: deviations [3, 3], [0, 0], [0, -3], norms
    # 3 sqrt(2), 0, 3 -> median 3: the first scaled by 1 / sqrt(2)
    expected = (np.array([0.0, 1.0]) + [3.0, 3.0] / np.sqrt(2) + [0.0, 1.0] + [0.0, -2.0]) / 3
    np.testing.assert_allclose(robust_mean(vectors, [1, 1, 1], "norm-clip"), expected)


def test_robust_layers_keep_dtypes_and_clip_the_whole_update():
    reference = [np.zeros(2, np.float32), np.array([7], np.int64)]
    clients = [[np.array([3.0, 4.0], np.float32), np.array([9], np.int64)],
               [np.array([0.0, 1.0], np.float32), np.array([8], np.int64)],
               [np.array([0.0, 2.0], np.float32), np.array([7], np.int64)]]
    median = robust_average_layers(clients, [1, 1, 1], "median")
    assert [a.dtype for a in median] == [np.float32, np.int64]
    np.testing.assert_array_equal(median[0], [0.0, 2.0])
    # update norms (float and integer entries alike): sqrt(25 + 4), sqrt(1 + 1), sqrt(4) -> median 2
    clipped = robust_average_layers(clients, [1, 1, 1], "norm-clip", reference=reference)
    scale = 2 / np.sqrt(29)
    np.testing.assert_allclose(clipped[0], (np.array([3.0, 4.0]) * scale + [0.0, 1.0] + [0.0, 2.0]) / 3, rtol=1e-6)
    method = robust_average_layers(clients, [1, 1, 2], "method")
    assert method[0].tolist() == weighted_average(clients, [1, 1, 2])[0].tolist()


def test_robust_prototype_rules_apply_per_class_over_its_holders():
    counts = np.array([[3, 1, 0], [1, 3, 0], [1, 1, 0]])
    prototypes = np.concatenate([PROTOTYPES, [[[5.0, 5.0], [5.0, 5.0], [0.0, 0.0]]]]).astype(np.float32)
    median, mask = aggregate_prototypes(prototypes, counts, "count", rule="median")
    np.testing.assert_allclose(median, [[3.0, 2.0], [4.0, 2.0], [0.0, 0.0]])
    assert mask.tolist() == [True, True, False]


@pytest.mark.parametrize("form", ["normalized", "raw-counts"])
def test_sigmoid_weights_are_finite_on_any_finite_input(form):
    for sizes, discrepancies in (
        ([100, 200, 300], [1e21, 1e22, 1e23]),  # every sigmoid underflows
        ([1e308, 1e308], [1.0, 2.0]),  # sums overflow
        ([1, 1], [0.0, 0.0]),
    ):
        weights = sigmoid_discrepancy_weights(np.array(sizes, float), np.array(discrepancies, float), form)
        assert np.isfinite(weights).all() and weights.sum() == pytest.approx(1.0)
    # in log space the least discrepant client still gets the most weight
    weights = sigmoid_discrepancy_weights(np.array([100.0, 100.0]), np.array([1e21, 3e21]), "raw-counts")
    assert weights[0] > weights[1]
