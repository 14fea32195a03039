"""FedNH: prototype init and update on hand-checked numbers, the frozen cosine head, the strategy."""

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.server import legacy_strategy
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, ClassStatistics, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fednh import (
    PROTOTYPES as PROTOTYPES_KEY,
)
from protofl.strategies.fednh import (
    FedNHClient,
    FedNHStrategy,
    orthogonal_prototypes,
    simplex_prototypes,
    update_prototypes,
)
from protofl.task.data import load_client_data, load_dataset
from protofl.task.train import train
from protofl.task.weights import get_weights


@pytest.mark.parametrize("classes,dim", [(2, 2), (10, 192), (100, 192), (10, 512)])
def test_simplex_init_is_unit_and_equiangular_at_minus_one_over_c_minus_one(classes, dim):
    prototypes = simplex_prototypes(classes, dim, seed=3)
    assert prototypes.shape == (classes, dim) and prototypes.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(prototypes, axis=1), 1.0, atol=1e-5)
    cosines = prototypes @ prototypes.T
    off_diagonal = cosines[~np.eye(classes, dtype=bool)]
    np.testing.assert_allclose(off_diagonal, -1.0 / (classes - 1), atol=1e-5)
    np.testing.assert_array_equal(prototypes, simplex_prototypes(classes, dim, seed=3))
    assert not np.allclose(prototypes, simplex_prototypes(classes, dim, seed=4))


def test_orthogonal_init_has_orthonormal_rows_and_too_many_classes_is_an_error():
    prototypes = orthogonal_prototypes(10, 192, seed=0)
    np.testing.assert_allclose(prototypes @ prototypes.T, np.eye(10), atol=1e-5)
    with pytest.raises(ValueError, match="feature size"):
        simplex_prototypes(200, 192, seed=0)


# Three classes in 2-d. Class 0: client A mean (0.3, 0.4) -> unit (0.6, 0.8), 3 samples; client B
# mean (0, 0.9) -> unit (0, 1), 1 sample. Class 1: client A only, mean (0.5, 0) -> unit (1, 0).
# Class 2: nobody this round.
PROTOTYPES = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], np.float32)
MEANS = np.array([[[0.3, 0.4], [0.5, 0.0], [0.0, 0.0]], [[0.0, 0.9], [0.0, 0.0], [0.0, 0.0]]], np.float32)
COUNTS = np.array([[3, 2, 0], [1, 0, 0]])


def test_prototype_update_on_a_hand_computed_example():
    updated = update_prototypes(PROTOTYPES, MEANS, COUNTS, rho=0.5)
    # class 0: m = (3 (0.6, 0.8) + (0, 1)) / 4 = (0.45, 0.85), |m| = sqrt(0.925) = 0.961769
    #   -> m^ = (0.467888, 0.883788); 0.5 (1, 0) + 0.5 m^ = (0.733944, 0.441894), norm 0.856706
    #   -> (0.856706, 0.515810)
    np.testing.assert_allclose(updated[0], [0.856706, 0.515810], atol=1e-5)
    # class 1: normalise(0.5 (0, 1) + 0.5 (1, 0)) = (1/sqrt 2, 1/sqrt 2)
    np.testing.assert_allclose(updated[1], [0.707107, 0.707107], atol=1e-6)
    # class 2: absent, unchanged
    np.testing.assert_array_equal(updated[2], PROTOTYPES[2])


def test_prototype_update_with_raw_means_and_rho_one():
    raw = update_prototypes(PROTOTYPES, MEANS, COUNTS, rho=0.5, normalize_means=False)
    # class 0: m = (3 (0.3, 0.4) + (0, 0.9)) / 4 = (0.225, 0.525); 0.5 (1, 0) + 0.5 m = (0.6125, 0.2625)
    #   norm sqrt(0.37515625 + 0.06890625) = 0.666380 -> (0.919145, 0.393919)
    np.testing.assert_allclose(raw[0], [0.919145, 0.393919], atol=1e-5)
    # class 1: 0.5 (0, 1) + 0.5 (0.5, 0) = (0.25, 0.5) -> (0.447214, 0.894427)
    np.testing.assert_allclose(raw[1], [0.447214, 0.894427], atol=1e-5)
    np.testing.assert_array_equal(update_prototypes(PROTOTYPES, MEANS, COUNTS, rho=1.0), PROTOTYPES)  # FedUH


def model_and_data(**options):
    config = ExperimentSettings(method="fednh", model="fednh-cnn", options=options)
    dataset = load_dataset("digits")
    return config, build_method_model(config, dataset), load_client_data("digits", "", config.partition_spec(4), 1)


def test_frozen_head_gets_no_update_and_is_not_a_parameter():
    _, model, data = model_and_data()
    prototypes = model.head.prototypes.clone()
    body_before = [p.detach().clone() for p in model.body.parameters()]
    assert list(model.head.parameters()) == []
    assert not any(k.startswith("head.") for k in model.state_dict())  # not among the sent parameters
    train(model, data.train_x, data.train_y, epochs=1, batch_size=10, lr=0.5, seed=0, momentum=0.9)
    assert torch.equal(model.head.prototypes, prototypes)
    assert model.head.scale.item() == 30.0
    assert all(not torch.equal(a, b) for a, b in zip(body_before, model.body.parameters()))


def test_learnable_scale_is_trained_and_sent_with_the_body():
    _, model, data = model_and_data(**{"learnable-scale": True, "scale": 1.0})
    assert "head.scale" in model.state_dict()
    train(model, data.train_x, data.train_y, epochs=1, batch_size=10, lr=0.05, seed=0)
    assert model.head.scale.item() != 1.0


def test_client_uploads_normalised_class_means_and_evaluates_its_trained_model():
    config, model, data = model_and_data()
    config = dataclasses.replace(config, global_test_pm=True)
    state = RecordDict()
    client = FedNHClient(config, data, model, 4, state)
    initial = get_weights(model)
    prototypes = model.head.prototypes.numpy().copy()
    fit_config = {"server-round": 1, "seed": 1, PROTOTYPES_KEY: encode_array(prototypes)}
    returned, n, metrics = client.fit(initial, fit_config)
    assert n == data.num_train
    means = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    np.testing.assert_array_equal(counts, data.class_counts())
    norms = np.linalg.norm(means, axis=1)
    assert (norms[counts > 0] > 0.1).all() and (norms <= 1 + 1e-5).all() and (norms[counts == 0] == 0).all()

    # evaluation uses the model right after training with the head it trained against, even when
    # the global parameters and newer prototypes arrive
    _, _, trained_result = client.evaluate(returned, {})
    fresh = FedNHClient(config, data, build_method_model(config, load_dataset("digits")), 4, state)
    newer = {PROTOTYPES_KEY: encode_array(np.roll(prototypes, 1, axis=0))}
    assert fresh.evaluate(initial, newer)[2] == trained_result
    assert 0.0 <= trained_result["pm-l"] <= 1.0 and 0.0 <= trained_result["pm-v"] <= 1.0


def test_strategy_updates_prototypes_averages_unweighted_and_rejects_inconsistent_payloads(tmp_path, caplog):
    config = ExperimentSettings(method="fednh", model="fednh-cnn", output_dir=str(tmp_path), run_name="run",
                              options={"rho": 0.5})
    model = build_method_model(config, load_dataset("digits"))
    strategy = legacy_strategy(FedNHStrategy)(config, model, 10)
    start_round(strategy, range(4))
    w0 = strategy.prototypes.copy()
    d = model.feature_dim

    def result(pid, value, counts, means=None):
        arrays = [(w * 0 + value).astype(w.dtype) for w in strategy.initial_weights]
        if means is None:
            means = np.zeros((10, d), np.float32)
            means[counts > 0] = w0[(np.arange(10) + 1) % 10][counts > 0]  # each class pulled toward the next
        metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(means, counts).to_metrics()}
        return FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(arrays), int(counts.sum()), metrics)

    counts_a = np.array([5, 5] + [0] * 8)
    counts_b = np.array([30, 0, 0, 10] + [0] * 6)
    bad_counts = result(2, 9.0, np.array([1] * 10))
    bad_counts[1].num_examples = 3
    too_long = result(3, 9.0, counts_a, means=np.full((10, d), 1.0, np.float32))
    parameters, metrics = strategy.aggregate_fit(1, [result(0, 1.0, counts_a), result(1, 3.0, counts_b),
                                                     bad_counts, too_long], [])
    assert metrics["accepted"] == 2
    assert "add up" in caplog.text and "norm above 1" in caplog.text
    np.testing.assert_allclose(parameters_to_ndarrays(parameters)[0], 2.0)  # (1 + 3) / 2, not by sample count
    expected = update_prototypes(w0, np.stack([np.where(c[:, None] > 0, w0[(np.arange(10) + 1) % 10], 0)
                                               for c in (counts_a, counts_b)]), np.stack([counts_a, counts_b]), 0.5)
    np.testing.assert_allclose(strategy.prototypes, expected, atol=1e-6)
    untouched = [2] + list(range(4, 10))
    np.testing.assert_array_equal(strategy.prototypes[untouched], w0[untouched])
    assert not np.allclose(strategy.prototypes[[0, 1, 3]], w0[[0, 1, 3]])
    sent = strategy.round_configs(2, [0])[0][PROTOTYPES_KEY]
    np.testing.assert_array_equal(np.load(io.BytesIO(sent)), strategy.prototypes)
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][0]
    assert record["rejected"] == 2
