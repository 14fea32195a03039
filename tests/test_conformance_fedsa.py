"""FedSA against numbers the authors' code (lokinko/FedSA) computed on the same inputs.

The fixtures (tests/conformance/fixtures/fedsa-*.npz) and the calls that made them are described in
tests/conformance/fedsa.py; their code is not run here. Both sides compute in float64
(tests/conformance/common.py), on the same float32 values where an array crosses our wire (the
anchors, the uploaded prototypes, whose margin is d* of round 2, the global prototypes), so most
comparisons are to ``FLOAT64``: the margins, the three losses and their gradients, the two local
rounds' weights (by fingerprint, ``FINGERPRINT``), features and logits, and d*.

Where protofl rounds to float32 on purpose, the tolerance is that rounding's
(``common.float32_roundings``; u = 2^-24, relative to the largest entry):

- A^0: ``initial_anchors`` returns the float32 anchors the server holds and broadcasts: one
  rounding;
- the server: the global prototypes P are returned as float32 (one rounding); the anchor step
  A <- alpha A + (1 - alpha) P takes that rounded P (weight 1 - alpha <= 1: u |P| at most) and
  returns float32 A (u |A|): two roundings on max(|A|, |P|), for A and for the move A - A^0 (1e-4
  of |P - A|: a wrong alpha moves it 10x more or less);
- a client's uploaded prototypes: the wire carries class means as float32, so one rounding (our
  training-mode sums are in the model's dtype; the rounding is the wire's contract).

The nearest-prototype score (a count of argmins) comes from the eval pass's float32 features
(``features_and_logits``: u per entry) and a float32 ``cdist`` (direct form below 25 rows: the
difference, its square and a sum of D = 512 of them, (D - 1)u + 2u, halved by the square root,
+ u): each distance to (D/2 + 3)u of the larger of it and the feature's norm. It equals theirs as
long as no sample's two nearest prototypes are within that: checked.
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64, assert_matches, fingerprint, float32_roundings, load_fixture
from conformance.fedsa import NUM_CLASSES, OUR_NAMES, pixels_to_input
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters
from torch import nn

from protofl.federation.server import legacy_strategy
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

pytestmark = pytest.mark.conformance

FEATURE_DIM = 512
# a fingerprint entry is an inner product with a fixed direction: weights that agree to FLOAT64's
# rtol (d <= rtol |w|) give entries that differ by about |d| <= rtol |w| (common.fingerprint), so
# compared relative to the weights' norm; the fingerprint's own float64 sums of N <= 5.3e5 terms
# (another BLAS kernel where the fixture was made) differ by about sqrt(N) u |g| |w| = N u |w|
# <= 6e-11 |w|, below that
FINGERPRINT = FLOAT64["rtol"]


def _largest(*arrays) -> float:
    """The largest magnitude of their entries (the scale of a float32 rounding's absolute part)."""
    return float(max(np.abs(np.asarray(a, dtype=np.float64)).max() for a in arrays))


def test_anchor_init_equals_the_codes():
    fixture = load_fixture("fedsa-anchors")
    given, theirs = fixture.inputs, fixture.outputs
    ours = initial_anchors(int(given["num_classes"]), int(given["dim"]), seed=int(given["seed"]))
    assert ours.dtype == np.float32  # what the server holds and broadcasts
    assert_matches(ours, theirs["anchors"], "A^0: N(0, I) through the untrained Linear-BN-ReLU x2",
                   **float32_roundings(1, scale=_largest(theirs["anchors"])))
    assert_matches(nearest_neighbour_margin(torch.from_numpy(theirs["anchors"])), theirs["global_margin"],
                   "the anchors' margin")


def test_margins_equal_the_codes():
    fixture = load_fixture("fedsa-losses")
    given, theirs = fixture.inputs, fixture.outputs
    anchors, previous = torch.from_numpy(given["anchors"]), torch.from_numpy(given["previous_prototypes"])
    assert_matches(nearest_neighbour_margin(anchors), theirs["global_margin"], "the anchors' margin")
    assert_matches(nearest_neighbour_margin(previous), theirs["local_margin"], "the prototypes' margin")
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
    strategy = legacy_strategy(FedSAStrategy)(settings, build_method_model(settings, data), NUM_CLASSES)
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
    assert_matches(strategy.global_prototypes.vectors, theirs["global_prototypes"],
                   "P: the unweighted mean over uploaders",
                   **float32_roundings(1, scale=_largest(theirs["global_prototypes"])))
    step = float32_roundings(2, scale=_largest(theirs["anchors"], theirs["global_prototypes"]))
    assert_matches(strategy.anchors, theirs["anchors"], "A after the EMA", **step)
    given_anchors = given["anchors"].astype(np.float64)
    assert_matches(strategy.anchors - given_anchors, theirs["anchors"] - given_anchors, "the anchors' move",
                   rtol=0.0, atol=step["atol"])
    untouched = ~theirs["mask"]
    np.testing.assert_array_equal(strategy.anchors[untouched], given["anchors"][untouched])


def _assert_weights(model, theirs, prefix):
    state = model.state_dict()
    for their_name, our_name in OUR_NAMES.items():
        expected = theirs[f"{prefix}.{their_name}"]
        assert_matches(fingerprint(state[our_name].numpy()), expected, f"{prefix} {our_name}", rtol=0.0,
                       atol=FINGERPRINT * expected[1])


def _forward(model, x):
    """(features, logits) in eval mode, in the model's float64 (not the float32 of the eval pass,
    ``features_and_logits``)."""
    model.eval()
    with torch.no_grad():
        return model(x)


def _assert_no_near_ties(features, prototypes):
    """No sample whose two nearest prototypes a float32 eval pass could swap (the docstring)."""
    distances = torch.cdist(features, prototypes).numpy()
    nearest = np.sort(distances, axis=1)[:, :2]
    scale = max(distances.max(), float(features.norm(dim=1).max()))
    tolerance = float32_roundings(FEATURE_DIM // 2 + 3, scale=scale)["atol"]
    assert (nearest[:, 1] - nearest[:, 0] > 2 * tolerance).all(), "two prototypes too close to compare the argmin"


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
        assert_matches(client.margin, theirs[f"{prefix}.margin"], f"{prefix} d*")
        _assert_weights(client.model, theirs, prefix)
        features, logits = _forward(client.model, data.train_x)
        assert_matches(features, theirs[f"{prefix}.features"], f"{prefix} features")
        assert_matches(logits, theirs[f"{prefix}.logits"], f"{prefix} logits")
        # the upload: class means of the training-mode features seen in both epochs
        prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        assert_matches(prototypes, theirs[f"{prefix}.prototypes"], f"{prefix} prototypes",
                       **float32_roundings(1, scale=_largest(theirs[f"{prefix}.prototypes"])))
        if server_round == 1:  # as our server broadcasts them (and the fixture gave their scoring): float32
            mask = np.load(io.BytesIO(metrics[CLASS_COUNTS])) > 0
            global_prototypes = ClassVectors(prototypes.astype(np.float32), mask)
    config = {"server-round": 2, "seed": 2} | anchors | {
        k: encode_array(v) for k, v in global_prototypes.to_config(GLOBAL_PROTOTYPES).items()}
    client = FedSAClient(settings, data, build_method_model(settings, data), 1, state)
    _, tested, scores = client.evaluate([], config)
    probe_features, _ = _forward(client.model, data.test_x)  # the personal model evaluate restored
    _assert_no_near_ties(probe_features, torch.from_numpy(global_prototypes.vectors[global_prototypes.mask]).double())
    assert tested == int(theirs["probe.tested"])
    assert scores["correct-prototype"] == int(theirs["probe.correct"])  # nearest global prototype
