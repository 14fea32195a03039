"""FedSC and FedSKC: the shared prototype math and each server formula on hand-checked numbers,
the client rules on digits, the strategies with fake client results."""

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fakes import OK, FakeProxy, start_round
from flwr.common import FitRes, ndarrays_to_parameters

from protofl.federation.server import legacy_strategy
from protofl.federation.wire import CLASS_MEANS, ClassStatistics, ClassVectors, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedsc import (
    CONSISTENT_PROTOTYPES,
    RELATIONAL_LABELS,
    RELATIONAL_PROTOTYPES,
    FedSCClient,
    FedSCStrategy,
    consistency_loss,
    consistent_prototypes,
    label_discrepancy,
    relational_prototypes,
    rpcl_loss,
)
from protofl.strategies.fedskc import (
    GLOBAL_KNOWLEDGE,
    FedSKCClient,
    FedSKCStrategy,
    gda_weights,
    global_knowledge,
    knowledge_discrepancy,
    lcl_loss,
    period_review,
    variance_ratio,
)
from protofl.task.data import load_client_data, load_dataset
from protofl.task.prototypes import multi_positive_infonce, neighbour_merge, sigmoid_discrepancy_weights
from protofl.task.statistics import class_means
from protofl.task.train import steps_per_epoch
from protofl.task.weights import get_weights

SIGMOID_HALF = 1 / (1 + math.exp(-0.5))  # sigma(0.5) = 0.6225; sigma(-0.5) = 1 - that


# --- shared math ------------------------------------------------------------------------


def test_angle_wise_neighbours_follow_the_angle_to_the_class_mean():
    v = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [2.0, 0.0]])
    # mean (1, 0.5); phi = cos(mean, v) = 0.894, 0.949, 0.447, 0.894
    merged = neighbour_merge(v, 2, "angle")
    np.testing.assert_allclose(merged[0], (v[0] + v[3] + v[1]) / 3)  # |phi| gaps 0 (v3), 0.054 (v1)
    np.testing.assert_allclose(merged[2], (v[2] + v[0] + v[3]) / 3)  # gaps 0.447, 0.447 < 0.502 (v1)
    # pairwise L2 picks by position instead: v2's nearest are v1 (1.0) and v0 (1.41)
    np.testing.assert_allclose(neighbour_merge(v, 2, "l2")[2], (v[2] + v[1] + v[0]) / 3)


def test_neighbour_merge_with_fewer_holders_than_m_and_with_none_to_merge():
    two = np.array([[0.0, 2.0], [4.0, 0.0]])
    np.testing.assert_allclose(neighbour_merge(two, 2, "angle"), [[2.0, 1.0], [2.0, 1.0]])  # M = 2, one peer
    np.testing.assert_allclose(neighbour_merge(two[:1], 2, "angle"), two[:1])  # a lone holder keeps its own
    np.testing.assert_allclose(neighbour_merge(two, 0, "angle"), two)  # M = 0: the raw prototypes


@pytest.mark.parametrize("metric", ["l1", "l2", "cosine", "kl"])
def test_pairwise_metrics_pick_the_obvious_neighbour(metric):
    v = np.array([[5.0, 1.0, 0.0], [4.9, 1.1, 0.0], [0.0, 0.2, 6.0]])
    np.testing.assert_allclose(neighbour_merge(v, 1, metric)[0], (v[0] + v[1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(neighbour_merge(v, 1, metric)[1], (v[0] + v[1]) / 2, rtol=1e-6)


def test_rpcl_on_a_two_class_toy_batch():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])
    y = torch.tensor([0, 1, 2])  # class 2 has no prototype: left out
    keys = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    key_labels = torch.tensor([0, 0, 1])
    r = math.sqrt(0.5)  # cos((1, 0), (1, 1))
    tau = 0.5
    # plain cosine: z0 scores (1, r, 0) with positives {0, 1}; z1 scores (0, r, 1) with positive {2}
    e = [math.exp(2.0), math.exp(r / tau), 1.0]
    expected = (math.log(sum(e)) - math.log(e[0] + e[1]) + math.log(sum(e)) - 2.0) / 2
    loss = multi_positive_infonce(z, y, keys, key_labels, tau, "none")
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # Eq. 13: U = mean distance of the batch's queries (z0, z1) to each key: (r, 1, r)
    e = [math.exp(1 / r / tau), math.exp(r / 1 / tau), 1.0]
    expected = (math.log(sum(e)) - math.log(e[0] + e[1]) + math.log(sum(e)) - 1 / r / tau) / 2
    loss = multi_positive_infonce(z[:2], y[:2], keys, key_labels, tau, "mean-distance")
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_one_key_per_class_is_cross_entropy_over_the_class_similarities():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3, 1, 0])
    knowledge = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    similarity = F.normalize(logits, dim=1) @ F.normalize(knowledge, dim=1).T
    expected = F.cross_entropy(similarity / 0.08, labels)
    assert multi_positive_infonce(logits, labels, knowledge, torch.arange(4), 0.08, "none").item() == pytest.approx(
        expected.item(), rel=1e-5
    )


def test_sigmoid_weights_normalized_and_as_printed_for_raw_counts():
    weights = sigmoid_discrepancy_weights([10, 10], [0.0, 0.5])  # shares (0.5, 0.5) - (0, 1)
    np.testing.assert_allclose(weights, [SIGMOID_HALF, 1 - SIGMOID_HALF])
    np.testing.assert_allclose(sigmoid_discrepancy_weights([300, 100], [1.0, 3.0], "raw-counts"), [0.5, 0.5])


# --- FedSC server -----------------------------------------------------------------------


def test_label_discrepancy_and_consistent_prototype_with_a_missing_class():
    np.testing.assert_allclose(label_discrepancy(np.array([[5, 5], [10, 0]])), [0.0, 0.5])
    relational = np.array([[[1.0], [2.0], [0.0]], [[4.0], [0.0], [0.0]]])  # K=2, C=3, d=1
    held = np.array([[True, True, False], [True, False, False]])
    consistent, mask = consistent_prototypes(relational, held, np.array([0.25, 0.75]))
    # class 0: 0.25 * 1 + 0.75 * 4; class 1: client 0 alone (renormalised); class 2: nobody
    np.testing.assert_allclose(consistent[:, 0], [3.25, 2.0, 0.0])
    assert mask.tolist() == [True, True, False]


def test_relational_prototypes_merge_per_class_among_its_holders():
    prototypes = np.zeros((3, 2, 1), np.float32)
    prototypes[:, 0, 0] = [1.0, 2.0, 6.0]
    prototypes[0, 1, 0] = 9.0
    held = np.array([[True, True], [True, False], [True, False]])
    relational = relational_prototypes(prototypes, held, neighbours=2, metric="l2")
    np.testing.assert_allclose(relational[:, 0, 0], [3.0, 3.0, 3.0])  # 3 holders, M = 2: all merged
    np.testing.assert_allclose(relational[:, 1, 0], [9.0, 0.0, 0.0])  # a lone holder; zeros elsewhere
    np.testing.assert_allclose(relational_prototypes(prototypes, held, 1, "l2")[:, 0, 0], [1.5, 1.5, 4.0])


def digits_strategy(cls, tmp_path, method, model="cnn", **options):
    config = ExperimentSettings(method=method, model=model, output_dir=str(tmp_path), run_name="run", options=options)
    strategy = legacy_strategy(cls)(config, build_method_model(config, load_dataset("digits")), 10)
    start_round(strategy, range(3))
    return strategy


def fit_result(pid, counts, parameters, means):
    metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(means, np.array(counts)).to_metrics()}
    return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(parameters), int(sum(counts)), metrics)


def test_fedsc_strategy_builds_and_sends_its_prototypes_in_the_fit_config_only(tmp_path, caplog):
    strategy = digits_strategy(FedSCStrategy, tmp_path, "fedsc")
    weights = strategy.initial_weights
    prototypes = [np.full((10, 512), v, np.float32) for v in (1.0, 3.0)]
    a = fit_result(0, [10] * 10, weights, prototypes[0])  # uniform labels: d = 0
    b = fit_result(1, [100] + [0] * 9, [w * 3 for w in weights], prototypes[1])  # one class: d = 0.67
    bad = fit_result(2, [10] * 10, weights, np.full((10, 512), np.nan, np.float32))
    parameters, metrics = strategy.aggregate_fit(1, [a, b, bad], [])
    assert metrics["accepted"] == 2 and "non-finite" in caplog.text
    sent = strategy.broadcast(2)
    # class 0 held by both (M = 2 merges them: 2.0 each), classes 1-9 by client 0 alone (1.0)
    assert sent[RELATIONAL_LABELS].tolist() == list(range(10)) + [0]
    np.testing.assert_allclose(sent[RELATIONAL_PROTOTYPES][:, 0], [2.0] + [1.0] * 9 + [2.0])
    np.testing.assert_allclose(sent[CONSISTENT_PROTOTYPES][:, 0], [2.0] + [1.0] * 9)
    assert sent[f"{CONSISTENT_PROTOTYPES}-mask"].all()
    record = strategy.recorder.rounds[1]
    d_share = np.array([0.0, 1.0])  # client b holds the whole discrepancy
    e = 1 / (1 + np.exp(-(np.array([100, 100]) / 200 - d_share)))
    assert record["consistent_weight_max"] == pytest.approx(e[0] / e.sum())
    # FedAvg by training size: (100 w + 100 * 3 w) / 200 = 2 w
    aggregated = np.load(io.BytesIO(parameters.tensors[0]))
    np.testing.assert_allclose(aggregated, 2 * weights[0], rtol=1e-6)
    fit = strategy.round_configs(2, [0])[0]
    assert RELATIONAL_PROTOTYPES in fit
    evaluate = strategy.configure_evaluate(strategy.settings.num_server_rounds, parameters, None)  # its own message
    assert RELATIONAL_PROTOTYPES not in evaluate[0][1].config


# --- FedSKC server ----------------------------------------------------------------------


def test_global_knowledge_merges_nearest_neighbours_then_averages():
    knowledge = np.zeros((3, 2, 2), np.float32)
    knowledge[:, 0, 0] = [0.0, 1.0, 5.0]  # class 0: a->b, b->a, c->b: (0.5, 0.5, 3), mean 4/3
    knowledge[2, 1] = [7.0, 7.0]  # class 1: client 2 alone
    held = np.array([[True, False], [True, False], [True, True]])
    merged, mask = global_knowledge(knowledge, held)
    np.testing.assert_allclose(merged, [[4 / 3, 0.0], [7.0, 7.0]], rtol=1e-6)
    assert mask.tolist() == [True, True]
    # d_k over the classes k holds: |0 - 4/3|, |1 - 4/3|, |5 - 4/3| + 0
    np.testing.assert_allclose(knowledge_discrepancy(knowledge, held, merged), [4 / 3, 1 / 3, 11 / 3], rtol=1e-6)


def test_the_three_gda_modes():
    sizes, discrepancies = np.array([300, 100]), np.array([1.0, 3.0])
    np.testing.assert_allclose(gda_weights(sizes, discrepancies, "paper"), [0.5, 0.5])  # sigma(~300), sigma(~100) = 1
    np.testing.assert_allclose(gda_weights(sizes, discrepancies, "normalized"), [SIGMOID_HALF, 1 - SIGMOID_HALF])
    np.testing.assert_allclose(gda_weights(sizes, discrepancies, "fedavg"), [0.75, 0.25])


def test_both_gpr_forms_change_only_trainable_arrays():
    weights, previous = [np.array([2.0]), np.array([10.0])], [np.array([1.0]), np.array([4.0])]
    paper = period_review(weights, previous, ratio=0.5, beta=0.9, form="paper", reviewed=[True, False])
    interp = period_review(weights, previous, ratio=0.5, beta=0.9, form="interp", reviewed=[True, False])
    assert paper[0].item() == pytest.approx(0.9 * 2 + 0.1 * 0.5 * (1 - 2))  # 1.75
    assert interp[0].item() == pytest.approx(2 + 0.1 * 0.5 * (1 - 2))  # 1.95
    assert paper[1].item() == interp[1].item() == 10.0  # a BatchNorm statistic is carried
    # per-class population variance over the C entries: now 1.0, before 0.25
    one = np.array([True])
    assert variance_ratio(ClassVectors(np.array([[0.0, 2.0]]), one), ClassVectors(np.array([[0.0, 1.0]]), one)) == (
        pytest.approx(3.0)
    )
    assert variance_ratio(ClassVectors(np.array([[0.0, 2.0]]), one), ClassVectors(np.zeros((1, 2)), one)) is None


def test_gpr_ratio_compares_only_the_classes_present_in_both_rounds():
    # class 0 (variance 1) both rounds; class 1 (variance 9) only now; class 2 (variance 4) only before
    now = ClassVectors(np.array([[0.0, 2.0], [0.0, 6.0], [0.0, 0.0]]), np.array([True, True, False]))
    before = ClassVectors(np.array([[0.0, 1.0], [0.0, 0.0], [0.0, 4.0]]), np.array([True, False, True]))
    # class 0 alone: (1 - 0.25) / 0.25 = 3; over each round's own classes it would be (10 - 4.25) / 4.25
    assert variance_ratio(now, before) == pytest.approx(3.0)


def test_lcl_forms_on_one_sample_by_hand():
    # logits (1, 0); knowledge of class 0 = (1, 0), class 1 = (0, 1): similarities 1 and 0, tau = 1
    logits, keys, classes = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    label = torch.tensor([0])
    paper = lcl_loss(logits, label, keys, classes, 1.0, "none", "paper")
    assert paper.item() == pytest.approx(math.log(1 + math.exp(-1)))  # -log(e / (e + 1))
    code = lcl_loss(logits, label, keys, classes, 1.0, "none", "code")
    assert code.item() == pytest.approx(math.log(2 + math.exp(-1)))  # -log(e / (e + e + 1)): positive twice
    # class 2 has no knowledge: the code's sample is its own positive (similarity 1), the paper's is left out
    assert lcl_loss(logits, torch.tensor([2]), keys, classes, 1.0, "none", "code").item() == pytest.approx(
        math.log(2 + math.exp(-1)))  # own 1, keys 1 and 0
    assert lcl_loss(logits, torch.tensor([2]), keys, classes, 1.0, "none", "paper").item() == 0.0
    # the code's form is plain cosine: the paper's normaliser U does not apply to it
    assert lcl_loss(logits, label, keys, classes, 1.0, "mean-distance", "code").item() == code.item()


def test_gpr_reviews_the_batchnorm_statistics_by_default(tmp_path):
    strategy = digits_strategy(FedSKCStrategy, tmp_path, "fedskc", "resnet8-x4")  # gpr-entries = "all"
    names = list(strategy.model.state_dict())
    assert strategy.reviewed[names.index("body.1.running_mean")]
    assert not strategy.reviewed[names.index("body.1.num_batches_tracked")]  # an integer: carried


def test_fedskc_strategy_reviews_trainable_parameters_from_round_two(tmp_path):
    strategy = digits_strategy(FedSKCStrategy, tmp_path, "fedskc", "resnet8-x4",
                               **{"gpr-form": "interp", "gpr-entries": "trainable"})
    start = strategy.initial_weights
    names = list(strategy.model.state_dict())
    statistic = names.index("body.1.running_mean")  # the stem's BatchNorm
    assert strategy.reviewed[0] and not strategy.reviewed[statistic]
    knowledge = np.eye(10, dtype=np.float32)
    shifted = [w + 1 if w.dtype.kind == "f" else w for w in start]
    updates = [fit_result(p, [10] * 10, shifted, knowledge * (p + 1)) for p in range(2)]
    parameters, _ = strategy.aggregate_fit(1, updates, [])
    first = [np.load(io.BytesIO(t)) for t in parameters.tensors]
    np.testing.assert_allclose(first[0], shifted[0], rtol=1e-6)  # round 1: GDA only (uniform), no GPR
    assert strategy.recorder.rounds[1]["gpr_ratio"] is None
    # round 2: the knowledge's variance doubles in scale (x2 values: x4 variance), so rho = 3
    updates = [fit_result(p, [10] * 10, [w + 1 for w in first], knowledge * 2 * (p + 1)) for p in range(2)]
    parameters, _ = strategy.aggregate_fit(2, updates, [])
    second = [np.load(io.BytesIO(t)) for t in parameters.tensors]
    assert strategy.recorder.rounds[2]["gpr_ratio"] == pytest.approx(3.0)
    # interp: w + (1 - 0.95) * 3 * (w_prev - w), with w = w_prev + 1
    np.testing.assert_allclose(second[0], first[0] + 1 - 0.05 * 3, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second[statistic], first[statistic] + 1, rtol=1e-6)  # carried, not reviewed
    # round 3: nobody holds class 9; over the nine classes held in rounds 2 and 3 the variance doubles
    # in scale again (rho = 3); comparing 9 classes now with 10 before would give 2.6
    held = [10] * 9 + [0]
    updates = [fit_result(p, held, [w + 1 for w in second], knowledge * 4 * (p + 1)) for p in range(2)]
    strategy.aggregate_fit(3, updates, [])
    assert strategy.recorder.rounds[3]["gpr_ratio"] == pytest.approx(3.0)


# --- clients on digits ------------------------------------------------------------------


def digits_client(cls, method, partition_id=1, **options):
    config = ExperimentSettings(method=method, local_epochs=1, options=options)
    data = load_client_data("digits", "", config.partition_spec(4), partition_id)
    return cls(config, data, build_method_model(config, data), 4, {})


def test_fedsc_client_trains_with_ce_only_in_round_one_then_adds_rpcl_and_cpdr():
    client = digits_client(FedSCClient, "fedsc")
    weights = [w.copy() for w in get_weights(client.model)]
    _, n, first = client.fit(weights, {"server-round": 1, "seed": 1})
    assert n == client.data.num_train and "rpcl-loss" not in first and "cpdr-loss" not in first
    prototypes = np.load(io.BytesIO(first[CLASS_MEANS]))
    features, _ = client.forward(client.data.train_x)  # post-eval: the trained model's
    np.testing.assert_allclose(prototypes, class_means(features, client.data.train_y, 10)[0], rtol=1e-5, atol=1e-6)
    held = client.data.class_counts() > 0
    config = {
        "server-round": 2, "seed": 2,
        RELATIONAL_PROTOTYPES: encode_array(prototypes[held]),
        RELATIONAL_LABELS: encode_array(np.flatnonzero(held).astype(np.int64)),
        **{k: encode_array(v) for k, v in ClassVectors(prototypes, held).to_config(CONSISTENT_PROTOTYPES).items()},
    }
    _, _, second = client.fit(weights, config)
    assert second["rpcl-loss"] > 0 and second["cpdr-loss"] > 0
    ablated = digits_client(FedSCClient, "fedsc", **{"use-rpcl": False})
    assert "rpcl-loss" not in ablated.fit(weights, config)[2]


def test_rpcl_code_form_by_hand():
    # two samples (classes 0 and 1), features (1, 0) and (0, 1); prototypes r0 = (1, 0) of class 0 and
    # r1 = (0, 1) of class 1; tau = 1. The code: own positive (similarity 1), and each prototype
    # counted once per sample of another class (r0 once, for sample 1; r1 once, for sample 0)
    features, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    keys, key_labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    # each sample: -log(e / (e + e^cos(z, r0) + e^cos(z, r1))) = -log(e / (e + e + 1))
    code = rpcl_loss(features, labels, keys, key_labels, 1.0, "none", "code")
    assert code.item() == pytest.approx(math.log(2 + math.exp(-1)))
    # a batch of class 0 only: r0 is nobody's negative, r1 twice: -log(e / (e + 2 e^0)) for sample 0
    code = rpcl_loss(features[:1].repeat(2, 1), torch.tensor([0, 0]), keys, key_labels, 1.0, "none", "code")
    assert code.item() == pytest.approx(math.log(1 + 2 * math.exp(-1)))
    paper = rpcl_loss(features, labels, keys, key_labels, 1.0, "none", "paper")
    assert paper.item() == pytest.approx(math.log(1 + math.exp(-1)))
    assert rpcl_loss(features, labels, keys, key_labels, 1.0, "mean-distance", "code").item() == pytest.approx(
        math.log(2 + math.exp(-1)))  # plain cosine: U does not apply


def test_cpdr_distances():
    features, labels = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1])
    consistent, mask = torch.tensor([[0.0, 0.0], [3.0, 0.0]]), torch.tensor([True, True])
    assert consistency_loss(features, labels, consistent, mask, "mse").item() == pytest.approx((1 + 4 + 16) / 4)
    assert consistency_loss(features, labels, consistent, mask, "l1").item() == pytest.approx((3 + 4) / 2)
    assert consistency_loss(features, labels, consistent, mask, "l2").item() == pytest.approx((math.sqrt(5) + 4) / 2)
    assert consistency_loss(features, labels, consistent, torch.tensor([True, False]), "mse").item() == 2.5


def test_fedskc_client_uploads_silu_mean_logits_and_adds_lcl_with_knowledge():
    client = digits_client(FedSKCClient, "fedskc")
    weights = [w.copy() for w in get_weights(client.model)]
    _, _, first = client.fit(weights, {"server-round": 1, "seed": 1})
    assert "lcl-loss" not in first
    _, logits = client.forward(client.data.train_x)
    means = class_means(logits, client.data.train_y, 10)[0]
    knowledge = np.load(io.BytesIO(first[CLASS_MEANS]))
    np.testing.assert_allclose(knowledge, means / (1 + np.exp(-means)), rtol=1e-5, atol=1e-6)  # c * sigmoid(c)
    raw = digits_client(FedSKCClient, "fedskc", silu=False)
    np.testing.assert_allclose(np.load(io.BytesIO(raw.fit(weights, {"server-round": 1, "seed": 1})[2][CLASS_MEANS])),
                               means, rtol=1e-5, atol=1e-6)
    mask = client.data.class_counts() > 0
    arrays = ClassVectors(knowledge, mask).to_config(GLOBAL_KNOWLEDGE)
    config = {"server-round": 2, "seed": 2, **{k: encode_array(v) for k, v in arrays.items()}}
    assert client.fit(weights, config)[2]["lcl-loss"] > 0
    assert "lcl-loss" not in digits_client(FedSKCClient, "fedskc", **{"use-lcl": False}).fit(weights, config)[2]


def test_last_epoch_prototypes_count_only_the_last_epochs_batches():
    client = digits_client(FedSCClient, "fedsc", **{"prototype-pass": "last-epoch"})
    client.settings = ExperimentSettings(method="fedsc", local_epochs=3, batch_size=10)
    collector = client.prototype_collector()
    assert collector.skip == 2 * steps_per_epoch(client.data.num_train, 10)
    assert digits_client(FedSCClient, "fedsc").prototype_collector() is None  # post-eval


def test_a_fedskc_run_says_at_its_start_which_forms_run_and_where_their_numbers_are(caplog):
    from markdown.extensions.toc import slugify

    from protofl.strategies.fedskc import FORMS_RESULTS, FedSKCStrategy

    for options, says in (({}, "GPR in the paper form (w <- 0.95 w + (1 - 0.95) rho (w_prev - w))"),
                          ({"gpr-form": "interp"}, "GPR in the interp form (w <- w + (1 - 0.95) rho (w_prev - w))"),
                          ({"use-gpr": False}, "no GPR")):
        caplog.clear()
        settings = ExperimentSettings(method="fedskc", options=options)
        legacy_strategy(FedSKCStrategy)(settings, build_method_model(settings, load_dataset("digits")), 10)
        assert says in caplog.text and FORMS_RESULTS in caplog.text
    path, anchor = FORMS_RESULTS.split("#")  # the page has that section, by the docs site's own anchors
    page = (Path(__file__).resolve().parents[1] / path).read_text()
    assert anchor in [slugify(line[3:], "-") for line in page.splitlines() if line.startswith("## ")]
