"""FedSA against numbers the authors' code (lokinko/FedSA) computed on the same inputs.

The fixtures (tests/conformance/fixtures/fedsa-*.npz) and the calls that made them are described in
tests/conformance/fedsa.py; their code is not run here.

Tolerances: losses, gradients, margins and averages are float32 sums in another order
(``FLOAT32_REORDERING``: rtol 1e-5, atol 1e-6; our margins are computed in float64, theirs in
float32). The anchor step moves an anchor by 1e-4 of its distance to the prototype, so it is
compared twice: the new anchors to rtol 1e-5, and the move itself to 1e-6 of the anchors' largest
entry (a float32 rounding of the anchors; a wrong alpha moves them 10x more or less). The two
rounds train the same network on the same full batches: weights' fingerprints, features, logits
and prototypes to 2e-5 relative (measured on this CPU: at most 4.6e-7, the logits).
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import assert_matches, fingerprint, load_fixture
from conformance.fedsa import NUM_CLASSES, OUR_NAMES, pixels_to_input
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters
from torch import nn

from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, GLOBAL_PROTOTYPES, ClassStatistics, ClassVectors, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedsa import (
    ANCHORS,
    FedSAClient,
    FedSAStrategy,
    anchor_calibration_loss,
    anchor_regularization,
    initial_anchors,
    margin_contrastive_loss,
    nearest_neighbour_margin,
)
from protofl.task.data import ClientData
from protofl.task.train import features_and_logits

pytestmark = pytest.mark.conformance

TRAINED = {"rtol": 2e-5, "atol": 1e-6}


def test_anchor_init_equals_the_codes():
    fixture = load_fixture("fedsa-anchors")
    given, theirs = fixture.inputs, fixture.outputs
    ours = initial_anchors(int(given["num_classes"]), int(given["dim"]), seed=int(given["seed"]))
    assert_matches(ours, theirs["anchors"], "A^0: N(0, I) through the untrained Linear-BN-ReLU x2")
    assert nearest_neighbour_margin(torch.from_numpy(ours)) == pytest.approx(float(theirs["global_margin"]), rel=1e-5)


def test_margins_equal_the_codes():
    fixture = load_fixture("fedsa-losses")
    given, theirs = fixture.inputs, fixture.outputs
    anchors, previous = torch.from_numpy(given["anchors"]), torch.from_numpy(given["previous_prototypes"])
    assert nearest_neighbour_margin(anchors) == pytest.approx(float(theirs["global_margin"]), rel=1e-5)
    assert nearest_neighbour_margin(previous) == pytest.approx(float(theirs["local_margin"]), rel=1e-5)
    # no prototypes yet: theirs 0; one class: theirs -inf; either way d* is the anchors' margin
    assert float(theirs["local_margin_first_round"]) == 0.0 and np.isneginf(theirs["local_margin_one_class"])
    assert nearest_neighbour_margin(previous[:1]) is None


@pytest.mark.parametrize("term", ["calibration", "regularization", "margin_contrastive", "total"])
def test_losses_and_their_gradients_equal_the_codes(term):
    fixture = load_fixture("fedsa-losses")
    given, theirs = fixture.inputs, fixture.outputs
    anchors, labels = torch.from_numpy(given["anchors"]), torch.from_numpy(given["labels"])
    features = torch.from_numpy(given["features"]).requires_grad_(True)
    head = nn.Linear(anchors.shape[1], len(anchors))
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(given["head_weight"]))
        head.bias.copy_(torch.from_numpy(given["head_bias"]))
    margin = max(float(theirs["global_margin"]), float(theirs["local_margin"]))  # d*, here the local one
    parts = {
        "calibration": lambda: anchor_calibration_loss(head, anchors),
        "regularization": lambda: anchor_regularization(features, labels, anchors),
        "margin_contrastive": lambda: margin_contrastive_loss(features, labels, anchors, margin),
    }
    if term == "total":
        loss = (float(given["lambda_cc"]) * parts["calibration"]() + float(given["lambda_r"]) * parts["regularization"]()
                + float(given["lambda_mcl"]) * parts["margin_contrastive"]())
    else:
        loss = parts[term]()
    loss.backward()
    assert_matches(loss.detach(), theirs[f"{term}.loss"], f"L ({term})")
    for name, grad in {"grad_features": features.grad, "grad_head_weight": head.weight.grad,
                       "grad_head_bias": head.bias.grad}.items():
        expected = theirs[f"{term}.{name}"]
        assert_matches(torch.zeros_like(torch.from_numpy(expected)) if grad is None else grad, expected,
                       f"{name} of L ({term})")


def test_server_prototype_average_and_anchor_step_equal_the_codes(tmp_path):
    fixture = load_fixture("fedsa-server")
    given, theirs = fixture.inputs, fixture.outputs
    settings = ExperimentSettings(method="fedsa", output_dir=str(tmp_path), run_name="conformance")
    data = ClientData(0, NUM_CLASSES, torch.zeros(2, 1, 28, 28), torch.tensor([0, 1]), torch.zeros(0, 1, 28, 28),
                      torch.zeros(0, dtype=torch.long))
    strategy = FedSAStrategy(settings, build_method_model(settings, data), NUM_CLASSES)
    strategy.anchors = given["anchors"].copy()
    clients = len(given["client_prototypes"])
    start_round(strategy, range(clients))
    results = []
    for pid, (prototypes, counts) in enumerate(zip(given["client_prototypes"], given["client_counts"])):
        metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(prototypes, counts).to_metrics()}
        results.append((FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters([]), int(counts.sum()), metrics)))
    _, metrics = strategy.aggregate_fit(1, results, [])
    assert metrics["accepted"] == clients
    np.testing.assert_array_equal(strategy.global_prototypes.mask, theirs["mask"])
    assert_matches(strategy.global_prototypes.vectors, theirs["global_prototypes"], "P: the unweighted mean over uploaders")
    assert_matches(strategy.anchors, theirs["anchors"], "A after the EMA")
    scale = np.abs(given["anchors"]).max()
    assert_matches(strategy.anchors - given["anchors"], theirs["anchors"] - given["anchors"], "the anchors' move",
                   rtol=0.0, atol=1e-6 * scale)
    untouched = ~theirs["mask"]
    np.testing.assert_array_equal(strategy.anchors[untouched], given["anchors"][untouched])


def _assert_weights(model, theirs, prefix):
    state = model.state_dict()
    for their_name, our_name in OUR_NAMES.items():
        expected = theirs[f"{prefix}.{their_name}"]
        assert_matches(fingerprint(state[our_name].numpy()), expected, f"{prefix} {our_name}", rtol=0.0,
                       atol=TRAINED["rtol"] * expected[1])


def test_two_local_rounds_and_the_prototype_score_equal_the_codes():
    fixture = load_fixture("fedsa-client-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    settings = ExperimentSettings(
        method="fedsa", model="cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]), batch_size=64,
        lr=float(given["lr"]), amp="off", channels_last=False,
        options={"lambda-r": float(given["lambda_r"]), "lambda-mcl": float(given["lambda_mcl"]),
                 "lambda-cc": float(given["lambda_cc"])},
    )
    data = ClientData(0, NUM_CLASSES, pixels_to_input(given["train.pixels"]), torch.from_numpy(given["train.labels"]),
                      pixels_to_input(given["probe.pixels"]), torch.from_numpy(given["probe.labels"]))
    state = RecordDict()
    anchors = {ANCHORS: encode_array(given["anchors"])}
    model = build_method_model(settings, data)
    with torch.no_grad():  # their head is drawn after a dropped one; the body is our seed-0 init
        model.head.weight.copy_(torch.from_numpy(theirs["initial.head.weight.full"]))
        model.head.bias.copy_(torch.from_numpy(theirs["initial.head.bias.full"]))
    _assert_weights(model, theirs, "initial")
    for server_round in (1, 2):
        client = FedSAClient(settings, data, model if server_round == 1 else build_method_model(settings, data), 1,
                             state)
        _, _, metrics = client.fit([], {"server-round": server_round, "seed": server_round} | anchors)
        prefix = f"round{server_round}"
        # d* = max(anchor margin, margin of last round's prototypes; none in round 1)
        assert client.margin == pytest.approx(float(theirs[f"{prefix}.margin"]), rel=1e-5)
        _assert_weights(client.model, theirs, prefix)
        features, logits = features_and_logits(client.model, data.train_x)
        assert_matches(features, theirs[f"{prefix}.features"], f"{prefix} features", **TRAINED)
        assert_matches(logits, theirs[f"{prefix}.logits"], f"{prefix} logits", **TRAINED)
        # the upload: class means of the training-mode features seen in both epochs
        prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        assert_matches(prototypes, theirs[f"{prefix}.prototypes"], f"{prefix} prototypes", **TRAINED)
        if server_round == 1:
            mask = np.load(io.BytesIO(metrics[CLASS_COUNTS])) > 0
            global_prototypes = ClassVectors(prototypes, mask).to_config(GLOBAL_PROTOTYPES)
    config = {"server-round": 2, "seed": 2} | anchors | {k: encode_array(v) for k, v in global_prototypes.items()}
    _, tested, scores = FedSAClient(settings, data, build_method_model(settings, data), 1, state).evaluate([], config)
    assert tested == int(theirs["probe.tested"])
    assert scores["correct-prototype"] == int(theirs["probe.correct"])  # nearest global prototype
