"""FedCoSR: the math on hand-checked numbers, the client rule on digits, the strategy."""

import io
import json
import math

import numpy as np
import pytest
import torch
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

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
from protofl.strategies.fedcosr import (
    FedCoSRClient,
    FedCoSRStrategy,
    mix_weights,
    mixing_weight,
    sample_infonce_losses,
)
from protofl.task.data import load_client_data, load_dataset
from protofl.task.statistics import class_means
from protofl.task.train import train
from protofl.task.weights import get_weights


def test_tau_from_a_given_loss():
    assert mixing_weight(0.5, gamma=2.0) == pytest.approx(math.exp(-1.0))  # 0.3679
    assert mixing_weight(0.0, gamma=1.0) == 1.0  # a perfectly separating client keeps its own phi
    assert mixing_weight(20.0, gamma=1.0) < 1e-8  # a lost one takes the global phi


def test_mix_weights_on_hand_made_arrays():
    local = [np.array([1.0, 2.0], np.float32), np.array([4], np.int64)]
    global_ = [np.array([5.0, 6.0], np.float32), np.array([8], np.int64)]
    mixed = mix_weights(local, global_, tau=0.25)
    np.testing.assert_allclose(mixed[0], [4.0, 5.0])  # 0.25 * 1 + 0.75 * 5, 0.25 * 2 + 0.75 * 6
    assert mixed[0].dtype == np.float32 and mixed[1].dtype == np.int64 and mixed[1][0] == 7


# Three classes in 2-d: p0 = (1, 0), p1 = (0, 1), p2 = (-1, 0) (scaled: only directions count).
PROTOTYPES = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])


def test_info_nce_takes_own_class_positive_and_every_other_prototype_negative():
    # the client holds only class 0; classes 1 and 2, which it never sees, are negatives
    features = torch.tensor([[0.5, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0])
    everything = torch.tensor([True, True, True])
    losses = sample_infonce_losses(features, labels, PROTOTYPES, everything, temperature=0.5)
    # sample 1: cos = (1, 0, -1), logits (2, 0, -2): -log(e^2 / (e^2 + 1 + e^-2)) = log(1 + e^-2 + e^-4)
    # sample 2: cos = (0, 1, 0), logits (0, 2, 0): log(1 + e^2 + 1) - 0
    expected = [math.log(1 + math.exp(-2) + math.exp(-4)), math.log(2 + math.exp(2))]
    np.testing.assert_allclose(losses.numpy(), expected, rtol=1e-6)
    # class 2 without a global prototype: not a negative
    without_2 = sample_infonce_losses(features, labels, PROTOTYPES, torch.tensor([True, True, False]), 0.5)
    np.testing.assert_allclose(without_2.numpy(), [math.log(1 + math.exp(-2)), math.log(1 + math.exp(2))], rtol=1e-6)
    # samples whose own class has no prototype are left out
    one_left = sample_infonce_losses(features, torch.tensor([2, 0]), PROTOTYPES, torch.tensor([True, True, False]), 0.5)
    assert len(one_left) == 1
    # no negatives: (1 - cos(w, p_y)) / tau_CL
    aligned = sample_infonce_losses(features, labels, PROTOTYPES, everything, 0.5, negatives=False)
    np.testing.assert_allclose(aligned.numpy(), [0.0, 2.0], atol=1e-7)
    # all prototypes equal: log C
    same = sample_infonce_losses(torch.randn(5, 2), torch.zeros(5, dtype=torch.long), torch.ones(3, 2), everything, 0.1)
    np.testing.assert_allclose(same.numpy(), math.log(3), rtol=1e-6)


def make_client(state, **options):
    config = ExperimentSettings(method="fedcosr", local_epochs=1, options=options)
    data = load_client_data("digits", "", config.partition_spec(4), 1)
    return FedCoSRClient(config, data, build_method_model(config, data), 4, state)


def body_arrays(client):
    return [v.numpy().copy() for k, v in client.model.state_dict().items() if k.startswith("body.")]


def prototype_config(server_round, prototypes, mask=None):
    mask = np.ones(len(prototypes), bool) if mask is None else mask
    arrays = ClassVectors(prototypes, mask).to_config(GLOBAL_PROTOTYPES)
    return {"server-round": server_round, "seed": server_round, **{k: encode_array(v) for k, v in arrays.items()}}


def test_client_keeps_its_head_sends_only_phi_and_mixes_by_its_last_loss():
    state = RecordDict()
    client = make_client(state)
    phi0 = body_arrays(client)
    head0 = client.model.head.weight.detach().clone()
    sent, n, metrics = client.fit(phi0, {"server-round": 1, "seed": 1})
    # what goes out: phi only (same names and shapes as the body), prototypes and counts as bytes
    assert [a.shape for a in sent] == [a.shape for a in phi0]
    assert [a.shape for a in client.get_parameters({})] == [a.shape for a in phi0]  # never the head
    for a, b in zip(sent, body_arrays(client)):
        np.testing.assert_array_equal(a, b)
    assert not any(v.shape == tuple(head0.shape) for v in sent)
    assert metrics["la-tau"] == 0.0 and "contrastive-loss" not in metrics  # round 1: CE only
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    features, _ = client.forward(client.data.train_x)
    expected, _ = class_means(features, client.data.train_y, 10)
    np.testing.assert_allclose(np.load(io.BytesIO(metrics[CLASS_MEANS])), expected, atol=1e-6)
    np.testing.assert_array_equal(counts, client.data.class_counts())
    assert n == client.data.num_train
    assert not torch.equal(client.model.head.weight, head0)  # the head trained and stays here

    # round 2 on a new client object (same node state): no last loss yet, so tau comes from an eval
    # pass of the stored model against the received prototypes (A3)
    trained_phi, trained_head = body_arrays(client), client.model.head.weight.detach().clone()
    prototypes = expected + 0.1
    again = make_client(state)
    again.has_personal_model = again.restore_personal_model()  # as fit does before receive
    feats, _ = again.forward(again.data.train_x)
    everything = torch.ones(10, dtype=bool)
    fresh_loss = sample_infonce_losses(feats, again.data.train_y, torch.from_numpy(prototypes), everything, 0.1)
    fresh_loss = fresh_loss.mean().item()
    global_phi = [a * 0 + 0.01 for a in trained_phi]
    tau = again._local_aggregation(global_phi, again.global_prototypes(again.round_of(prototype_config(2, prototypes))))
    assert tau == pytest.approx(math.exp(-fresh_loss), rel=1e-5)
    for mixed, local, glob in zip(body_arrays(again), trained_phi, global_phi):
        np.testing.assert_allclose(mixed, tau * local + (1 - tau) * glob, rtol=1e-5, atol=1e-6)
    assert torch.equal(again.model.head.weight, trained_head)  # the head is not mixed

    # after a round with prototypes, the next tau comes from the stored last-epoch loss
    _, _, metrics = make_client(state).fit(global_phi, prototype_config(2, prototypes))
    assert metrics["la-tau"] == pytest.approx(tau, rel=1e-5) and metrics["contrastive-loss"] > 0
    assert float(make_client(state).local_state["last-contrastive-loss"]) == metrics["contrastive-loss"]
    third = make_client(state)
    third.has_personal_model = third.restore_personal_model()
    tau3 = third._local_aggregation(global_phi, third.global_prototypes(third.round_of(prototype_config(3, prototypes))))
    assert tau3 == pytest.approx(math.exp(-metrics["contrastive-loss"]), rel=1e-6)


def test_without_contrastive_loss_and_local_aggregation_it_is_ce_on_global_phi_and_own_head():
    """contrastive-weight = 0 and tau = 0 is FedPer: overwrite phi, keep the head, train with CE."""
    options = {"contrastive-weight": 0.0, "local-aggregation": "fixed", "fixed-tau": 0.0}
    state = RecordDict()
    client = make_client(state, **options)
    client.fit(body_arrays(client), {"server-round": 1, "seed": 1})
    after_round_1 = {k: v.clone() for k, v in client.model.state_dict().items()}
    global_phi = [a + 0.01 for a in body_arrays(client)]
    prototypes = np.random.default_rng(0).random((10, 512)).astype(np.float32)
    sent, _, metrics = make_client(state, **options).fit(global_phi, prototype_config(2, prototypes))
    assert metrics["la-tau"] == 0.0 and metrics["contrastive-loss"] > 0  # still measured, to drive tau

    reference = make_client(RecordDict())
    reference.model.load_state_dict(after_round_1)
    reference.load_shared(global_phi)
    train(reference.model, reference.data.train_x, reference.data.train_y, **reference.train_kwargs(reference.round_of({"seed": 2})))
    for a, b in zip(sent, body_arrays(reference)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_strategy_weights_phi_by_size_prototypes_by_class_counts_and_keeps_missing_classes(tmp_path, caplog):
    config = ExperimentSettings(method="fedcosr", output_dir=str(tmp_path), run_name="run")
    strategy = legacy_strategy(FedCoSRStrategy)(config, build_method_model(config, load_dataset("digits")), 10)
    start_round(strategy, range(4))
    phi = strategy.shared_weights()
    assert len(phi) == len(strategy.initial_weights) - 2  # everything but the head's weight and bias
    d = strategy.feature_dim

    def result(pid, value, counts, class_values, tau=0.5, arrays=None):
        prototypes = np.zeros((10, d), np.float32)
        for c, v in class_values.items():
            prototypes[c] = v
        arrays = arrays if arrays is not None else [np.full_like(w, value) for w in phi]
        metrics = {"partition-id": pid, "train-loss": 1.0, "la-tau": tau, "contrastive-loss": 0.7,
                   **ClassStatistics(prototypes, np.array(counts)).to_metrics()}
        return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(arrays), int(sum(counts)), metrics)

    a = result(0, 1.0, [3, 1] + [0] * 8, {0: 1.0, 1: 2.0})
    b = result(1, 8.0, [1, 0, 2] + [0] * 7, {0: 5.0, 2: 4.0}, tau=0.1)
    with_head = result(2, 0.0, [1] * 10, {}, arrays=strategy.initial_weights)
    bad_tau = result(3, 0.0, [1] * 10, {}, tau=1.5)
    parameters, metrics = strategy.aggregate_fit(1, [a, b, with_head, bad_tau], [])
    assert metrics["accepted"] == 2
    assert "parameter arrays" in caplog.text and "la-tau" in caplog.text
    np.testing.assert_allclose(parameters_to_ndarrays(parameters)[0], (4 * 1.0 + 3 * 8.0) / 7)  # Eq. 5
    # Eq. 6: class 0 (3 * 1 + 1 * 5) / 4 = 2, class 1 only from A, class 2 only from B
    np.testing.assert_allclose(strategy.global_prototypes.vectors[:3, 0], [2.0, 2.0, 4.0])
    assert strategy.global_prototypes.mask.tolist() == [True] * 3 + [False] * 7
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert (record["la_tau_mean"], record["la_tau_min"], record["la_tau_max"]) == pytest.approx((0.3, 0.1, 0.5))

    # round 2: only class 0 reported; classes 1 and 2 keep last round's prototypes
    start_round(strategy, [0], 4)
    strategy.aggregate_fit(2, [result(0, 1.0, [4] + [0] * 9, {0: 9.0})], [])
    np.testing.assert_allclose(strategy.global_prototypes.vectors[:3, 0], [9.0, 2.0, 4.0])
    assert strategy.global_prototypes.mask.sum() == 3
    sent = strategy.round_configs(3, [0])[0]
    np.testing.assert_array_equal(np.load(io.BytesIO(sent[GLOBAL_PROTOTYPES])), strategy.global_prototypes.vectors)

    dropping = legacy_strategy(FedCoSRStrategy)(ExperimentSettings(method="fedcosr", output_dir=str(tmp_path), run_name="run2",
                                                options={"keep-missing-prototypes": False}),
                               build_method_model(config, load_dataset("digits")), 10)
    start_round(dropping, [0, 1], 4)
    dropping.aggregate_fit(1, [a, b], [])
    start_round(dropping, [0], 4)
    dropping.aggregate_fit(2, [result(0, 1.0, [4] + [0] * 9, {0: 9.0})], [])
    assert dropping.global_prototypes.mask.tolist() == [True] + [False] * 9


def test_share_head_ablation_exchanges_and_mixes_the_whole_model():
    config = ExperimentSettings(method="fedcosr", options={"share-head": True})
    strategy = legacy_strategy(FedCoSRStrategy)(config, build_method_model(config, load_dataset("digits")), 10)
    assert strategy.has_global_model and len(strategy.shared_weights()) == len(strategy.initial_weights)
    state = RecordDict()
    client = make_client(state, **{"share-head": True, "local-aggregation": "fixed", "fixed-tau": 0.5})
    client.fit(get_weights(client.model), {"server-round": 1, "seed": 1})
    trained = get_weights(client.model)
    zeros = [np.zeros_like(w) for w in trained]
    again = make_client(state, **{"share-head": True, "local-aggregation": "fixed", "fixed-tau": 0.5})
    again.has_personal_model = again.restore_personal_model()
    assert again._local_aggregation(zeros, None) == 0.5
    for mixed, local in zip(get_weights(again.model), trained):
        np.testing.assert_allclose(mixed, 0.5 * local, rtol=1e-6)  # the head too


def test_fresh_eval_tau_and_evaluation_after_aggregation():
    state = RecordDict()
    client = make_client(state)
    client.fit(body_arrays(client), {"server-round": 1, "seed": 1})
    prototypes = class_means(client.forward(client.data.train_x)[0], client.data.train_y, 10)[0]
    _, _, metrics = make_client(state).fit(body_arrays(client), prototype_config(2, prototypes))
    stored = metrics["contrastive-loss"]

    fresh = make_client(state, **{"tau-loss": "fresh-eval"})
    fresh.has_personal_model = fresh.restore_personal_model()
    features, _ = fresh.forward(fresh.data.train_x)
    everything = torch.ones(10, dtype=bool)
    expected = sample_infonce_losses(features, fresh.data.train_y, torch.from_numpy(prototypes), everything, 0.1)
    expected = expected.mean().item()
    assert expected != pytest.approx(stored, rel=1e-3)
    global_phi = [a * 0 for a in body_arrays(fresh)]
    tau = fresh._local_aggregation(global_phi, fresh.global_prototypes(fresh.round_of(prototype_config(3, prototypes))))
    assert tau == pytest.approx(math.exp(-expected), rel=1e-5)

    # PM after fit scores the stored model; after aggregation, the stored model mixed with global phi
    config = prototype_config(3, prototypes)
    after_fit = make_client(state).evaluate(global_phi, config)
    after_aggregation = make_client(state, **{"evaluate-at": "after-aggregation"}).evaluate(global_phi, config)
    stored_model = make_client(state)
    stored_model.restore_personal_model()
    assert after_fit == stored_model.score(stored_model.predictors())
    assert after_aggregation[0] != after_fit[0]
