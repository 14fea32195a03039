"""FedSA: the math on hand-checked numbers, the client rule on digits, the strategy."""

import io
import json
import math

import numpy as np
import pytest
import torch
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters

from protofl.federation.server import legacy_strategy
from protofl.federation.wire import (
    CLASS_COUNTS,
    CLASS_MEANS,
    GLOBAL_PROTOTYPES,
    ClassStatistics,
    ClassVectors,
    encode_array,
)
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedsa import (
    ANCHORS as ANCHORS_KEY,
)
from protofl.strategies.fedsa import (
    FedSAClient,
    FedSAOptions,
    FedSAStrategy,
    anchor_calibration_loss,
    anchor_regularization,
    batch_class_means,
    ema_update,
    initial_anchors,
    margin_contrastive_loss,
    nearest_neighbour_margin,
    pairwise_margin,
)
from protofl.task.data import load_client_data, load_dataset
from protofl.task.models import build_model
from protofl.task.weights import get_weights


def test_anchors_are_deterministic_per_seed_and_look_like_the_spec():
    a, b, other = initial_anchors(10, 512, seed=3), initial_anchors(10, 512, seed=3), initial_anchors(10, 512, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, other)
    # after BN + ReLU: non-negative, about half exactly zero, norm ~16, mean nearest-anchor distance ~18 (spec 2.2)
    assert a.dtype == np.float32 and a.shape == (10, 512) and (a >= 0).all()
    assert 0.45 < (a == 0).mean() < 0.55
    assert np.linalg.norm(a, axis=1).mean() == pytest.approx(16.0, abs=0.5)
    assert nearest_neighbour_margin(torch.from_numpy(a)) == pytest.approx(18.3, abs=0.5)
    raw = initial_anchors(10, 512, seed=3, projected=False)  # "no ER": plain N(0, I)
    assert (raw < 0).mean() == pytest.approx(0.5, abs=0.05) and raw.std() == pytest.approx(1.0, abs=0.05)


def test_ema_moves_only_the_classes_seen_this_round():
    anchors = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32)
    prototypes = np.array([[3.0, 0.0], [9.0, 9.0], [0.0, 4.0]], np.float32)
    updated = ema_update(anchors, prototypes, np.array([True, False, True]), alpha=0.75)
    # class 0: 0.75 * (1, 0) + 0.25 * (3, 0); class 1 unseen: unchanged; class 2: 0.75 * (2, 2) + 0.25 * (0, 4)
    np.testing.assert_allclose(updated, [[1.5, 0.0], [0.0, 1.0], [1.5, 2.5]])
    assert updated.dtype == np.float32
    np.testing.assert_array_equal(ema_update(anchors, prototypes, np.ones(3, bool), alpha=1.0), anchors)


def test_margin_is_the_mean_nearest_neighbour_distance():
    points = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    assert nearest_neighbour_margin(points) == pytest.approx((3 + 3 + 4) / 3)  # nearest: 3, 3, 4
    assert nearest_neighbour_margin(points[:1]) is None  # a single class has no margin
    # the paper's Eq. 6: ordered pairs (3 + 4 + 5) * 2 / (N - 1)^2 = 24 / 4
    assert pairwise_margin(points) == pytest.approx(6.0) and pairwise_margin(points[:1]) is None


def test_each_loss_on_a_toy_batch():
    anchors = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    features = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1])
    # L_R: ((3^2 + 4^2) + (1^2 + 0^2)) / (B * D = 4)
    assert anchor_regularization(features, labels, anchors).item() == pytest.approx(26 / 4)
    # L_MCL with d* = 1: sample 1 distances (5, 1) -> logits (-(5 + 1), -1): log(1 + e^(6 - 1))
    # sample 2 distances (sqrt(13), 1) -> logits (-sqrt(13), -(1 + 1)): log(1 + e^(2 - sqrt(13)))
    expected = (math.log(1 + math.exp(5)) + math.log(1 + math.exp(2 - math.sqrt(13)))) / 2
    assert margin_contrastive_loss(features, labels, anchors, margin=1.0).item() == pytest.approx(expected, rel=1e-5)
    # a larger margin can only make the loss larger
    wider = margin_contrastive_loss(features, labels, anchors, 3.0)
    assert wider > margin_contrastive_loss(features, labels, anchors, 1.0)
    # L_CC: head = identity weights, zero bias: logits of anchor 0 (3, 4), of anchor 1 (0, 1)
    head = torch.nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
        head.bias.zero_()
    expected = (math.log(1 + math.exp(1)) + math.log(1 + math.exp(-1))) / 2  # -log softmax_0(3, 4), _1(0, 1)
    assert anchor_calibration_loss(head, anchors).item() == pytest.approx(expected, rel=1e-6)


def test_paper_loss_form_uses_the_batch_class_means():
    anchors = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    features = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 1.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 1])
    classes, means = batch_class_means(features, labels)
    assert classes.tolist() == [0, 1] and means.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    client = make_client(RecordDict(), options={"loss-form": "prototype"})
    regularization, contrastive = client._regularization_and_contrastive(features, labels, anchors, 0.0)
    # ||(1, 0) - (3, 4)|| + ||(0, 1) - (0, 1)|| = sqrt(20)
    assert regularization.item() == pytest.approx(math.sqrt(20))
    assert contrastive.item() == pytest.approx(margin_contrastive_loss(means, classes, anchors, 0.0).item())
    regularization.backward()
    assert features.grad is not None and features.grad[2].abs().sum() == 0  # class 1's mean sits on its anchor


def test_calibration_gradient_reaches_only_the_head():
    model = build_model("cnn", 1, 10, 16, seed=0)
    anchors = torch.from_numpy(initial_anchors(10, 512, seed=0))
    anchor_calibration_loss(model.head, anchors).backward()
    assert all(p.grad is None for p in model.body.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.head.parameters())


def test_lambda_mcl_auto_follows_the_model_setting():
    homogeneous, family = ExperimentSettings(method="fedsa"), ExperimentSettings(method="fedsa", model="htfe2")
    assert FedSAOptions.from_settings(homogeneous).mcl_weight(homogeneous) == 0.01
    assert FedSAOptions.from_settings(family).mcl_weight(family) == 1.0
    explicit = ExperimentSettings(method="fedsa", model="htfe2", options={"lambda-mcl": 0.5})
    assert FedSAOptions.from_settings(explicit).mcl_weight(explicit) == 0.5
    with pytest.raises(ValueError, match="lambda-mcl"):
        FedSAOptions.from_settings(ExperimentSettings(method="fedsa", options={"lambda-mcl": "big"}))


ANCHORS = initial_anchors(10, 512, seed=0)


def make_client(state, partition_id=1, **config_values):
    config = ExperimentSettings(method="fedsa", local_epochs=1, **config_values)
    data = load_client_data("digits", "", config.partition_spec(4), partition_id)
    return FedSAClient(config, data, build_method_model(config, data), 4, state)


def anchor_config(server_round, anchors=ANCHORS, prototypes=None):
    arrays = {ANCHORS_KEY: anchors} | (ClassVectors(*prototypes).to_config(GLOBAL_PROTOTYPES) if prototypes else {})
    return {"server-round": server_round, "seed": server_round, **{k: encode_array(v) for k, v in arrays.items()}}


def test_client_sends_no_parameters_keeps_its_model_and_its_prototype_margin():
    state = RecordDict()
    client = make_client(state)
    initial = [w.copy() for w in get_weights(client.model)]
    sent, n, metrics = client.fit([], anchor_config(1))
    assert sent == [] and client.get_parameters({}) == [] and n == client.data.num_train
    assert {"regularization-loss", "margin-contrastive-loss", "calibration-loss"} <= set(metrics)
    prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    assert counts.sum() == n and (prototypes[counts == 0] == 0).all() and (prototypes[counts > 0] != 0).any()
    # the margin it keeps is that of its uploaded prototypes, and d* = max(anchor margin, own margin)
    own = nearest_neighbour_margin(torch.from_numpy(prototypes[counts > 0]))
    assert client.local_state["prototype-margin"] == pytest.approx(own)
    anchor_margin = nearest_neighbour_margin(torch.from_numpy(ANCHORS))
    assert client._margin(torch.from_numpy(ANCHORS)) == pytest.approx(max(anchor_margin, own))
    assert client._margin(torch.from_numpy(ANCHORS) * 100) == pytest.approx(anchor_margin * 100)

    # a new client object (as Flower makes each round) starts from the trained model, not a fresh one
    again = make_client(state)
    assert again.restore_personal_model()
    for trained, restored, first in zip(get_weights(client.model), get_weights(again.model), initial):
        np.testing.assert_array_equal(trained, restored)
    assert any(not np.array_equal(a, b) for a, b in zip(get_weights(again.model), initial))


def test_prototypes_are_the_means_of_the_training_features_seen_or_of_an_eval_pass():
    client = make_client(RecordDict())
    _, _, metrics = client.fit([], anchor_config(1))
    during = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    post = make_client(RecordDict(), options={"prototype-pass": "post-eval"})
    _, _, metrics = post.fit([], anchor_config(1))
    from protofl.task.statistics import class_means

    expected, _ = class_means(post.forward(post.data.train_x)[0], post.data.train_y, 10)
    np.testing.assert_allclose(np.load(io.BytesIO(metrics[CLASS_MEANS])), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(during, expected, atol=1e-3)  # features from before each step differ


def test_a_single_class_client_uses_the_anchor_margin():
    import dataclasses

    state = RecordDict()
    client = make_client(state)
    keep = client.data.train_y == client.data.train_y[0]
    client.data = dataclasses.replace(client.data, train_x=client.data.train_x[keep], train_y=client.data.train_y[keep])
    client.fit([], anchor_config(1))
    assert "prototype-margin" not in client.local_state
    anchors = torch.from_numpy(ANCHORS)
    assert client._margin(anchors) == nearest_neighbour_margin(anchors)


def test_evaluation_logs_prototype_anchor_and_head_predictions():
    state = RecordDict()
    client = make_client(state)
    _, _, fit_metrics = client.fit([], anchor_config(1))
    prototypes = np.load(io.BytesIO(fit_metrics[CLASS_MEANS]))
    mask = np.load(io.BytesIO(fit_metrics[CLASS_COUNTS])) > 0
    config = anchor_config(1, prototypes=(prototypes, mask))
    _, n, metrics = make_client(state).evaluate([], config)
    assert n == client.data.num_test
    assert {"correct-prototype", "correct-anchor", "correct-head"} <= set(metrics)
    assert metrics["correct"] == metrics["correct-prototype"]
    _, _, by_head = make_client(state, options={"inference": "head"}).evaluate([], config)
    assert by_head["correct"] == by_head["correct-head"] == metrics["correct-head"]


def test_an_architecture_with_another_feature_size_is_a_clear_error():
    config = ExperimentSettings(method="fedsa", local_epochs=1)
    data = load_client_data("digits", "", config.partition_spec(4), 0)
    client = FedSAClient(config, data, build_method_model(config, data, "fednh-cnn"), 4, RecordDict())
    with pytest.raises(ValueError, match="512-d, but this client's model gives 192-d"):
        client.fit([], anchor_config(1))


def test_strategy_averages_prototypes_moves_anchors_and_sends_the_same_anchors_to_everyone(tmp_path, caplog):
    config = ExperimentSettings(method="fedsa", output_dir=str(tmp_path), run_name="run", options={"ema": 0.5})
    strategy = legacy_strategy(FedSAStrategy)(config, build_method_model(config, load_dataset("digits")), 10)
    assert strategy.shared_weights() == [] and strategy.initialize_parameters(None).tensors == []
    np.testing.assert_array_equal(strategy.anchors, initial_anchors(10, 512, seed=0))
    start_round(strategy, range(3))
    configs = strategy.round_configs(1, [0, 1, 2])
    assert len({c[ANCHORS_KEY] for c in configs}) == 1 and GLOBAL_PROTOTYPES not in configs[0]
    np.testing.assert_array_equal(np.load(io.BytesIO(configs[0][ANCHORS_KEY])), strategy.anchors)

    def result(pid, counts, class_values, **metrics):
        prototypes = np.zeros((10, 512), np.float32)
        for c, v in class_values.items():
            prototypes[c] = v
        metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(prototypes, np.array(counts)).to_metrics(),
                   **metrics}
        return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters([]), int(sum(counts)), metrics)

    before = strategy.anchors.copy()
    a = result(0, [3, 1] + [0] * 8, {0: 1.0, 1: 2.0}, **{"margin-contrastive-loss": 1.0})
    b = result(1, [1, 0, 2] + [0] * 7, {0: 5.0, 2: 4.0}, **{"margin-contrastive-loss": 3.0})
    bad = result(2, [1] * 10, {}, **{"margin-contrastive-loss": -1.0})
    parameters, metrics = strategy.aggregate_fit(1, [a, b, bad], [])
    assert parameters.tensors == [] and metrics["accepted"] == 2 and "margin-contrastive-loss" in caplog.text
    # unweighted mean over uploaders: class 0 (1 + 5) / 2 = 3 (count-weighted would be 2)
    np.testing.assert_allclose(strategy.global_prototypes.vectors[:3, 0], [3.0, 2.0, 4.0])
    assert strategy.global_prototypes.mask.tolist() == [True] * 3 + [False] * 7
    np.testing.assert_allclose(strategy.anchors[0], 0.5 * before[0] + 0.5 * 3.0, rtol=1e-6)
    np.testing.assert_array_equal(strategy.anchors[3:], before[3:])  # unseen classes keep their anchors
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert record["margin_contrastive_loss"] == pytest.approx((4 * 1.0 + 3 * 3.0) / 7)
    assert record["anchor_drift"] > 0 and record["prototype_margin"] > 0

    weighted = legacy_strategy(FedSAStrategy)(
        ExperimentSettings(method="fedsa", output_dir=str(tmp_path), run_name="w", options={"proto-agg": "weighted"}),
        strategy.model, 10,
    )
    start_round(weighted, [0, 1], 3)
    weighted.aggregate_fit(1, [a, b], [])
    assert weighted.global_prototypes.vectors[0, 0] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)
    sent = weighted.round_configs(2, [0])[0]
    assert {ANCHORS_KEY, GLOBAL_PROTOTYPES, f"{GLOBAL_PROTOTYPES}-mask"} <= set(sent)


def test_a_model_family_with_a_method_that_exchanges_parameters_is_refused(tmp_path):
    from protofl.strategies.fedavg import FedAvgStrategy

    config = ExperimentSettings(method="fedavg", model="htfe2", output_dir=str(tmp_path))
    strategy = legacy_strategy(FedAvgStrategy)(config, build_method_model(config, load_dataset("digits")), 10)
    with pytest.raises(ValueError, match="different architectures"):
        strategy.initialize_parameters(None)
