"""FedNH against numbers the authors' code (Yutong-Dai/FedNH) computed on the same inputs.

The fixtures (tests/conformance/fixtures/fednh-*.npz) and the calls that made them are described
in tests/conformance/fednh.py; their code is not run here. Both sides compute in float64
(tests/conformance/common.py), on the same float32 values where an array crosses our wire (W^0,
the server step's W and class means), so most comparisons are to ``FLOAT64``: the orthonormal
init, the body average, the first step's logits, loss and gradients, the trained clients' weights,
s, unit features and logits, the averaged body and s. Weights, too large to store, are compared
by fingerprint (``FINGERPRINT``).

Where protofl rounds to float32 on purpose, the tolerance is that rounding's
(``common.float32_roundings``; u = 2^-24):

- the server step (``update_prototypes``) returns the float32 W the wire carries: one rounding of
  entries of magnitude <= 1;
- a client's upload: its eval pass rounds the features to float32 (``features_and_logits``), the
  class means are taken in float32 (``prototype_vectors``: F.normalize; ``class_means``). The
  features are ReLU outputs (>= 0), so every error is relative to its entry: the rounding u, the
  norm of d = 192 squares summed in any order (d - 1)u + u, halved by the square root, + u, the
  division u, the rounded feature's norm u: a unit feature to (d/2 + 4)u; a class sum of n <= 5
  of them (n - 1)u and the division u: a class mean to e = (d/2 + 9)u. The test normalises it (a
  norm off by e too): count x unit mean to 2e = (d + 18)u relative, entries <= the count
  (``UPLOAD_ROUNDINGS``, scale the largest count);
- W^{t+1} from those means: normalising a vector off by e moves it by 2e (a - b over |a|, twice);
  the count-weighted mean of <= 2 clients' non-negative unit means has norm >= 1/sqrt(2), so its
  normalisation moves by <= 4 sqrt(2) e; rho W + (1 - rho) m by (1 - rho) of that, with norm >=
  rho - (1 - rho) = 0.8, normalised: <= 1.5e; the float32 rounding u: < 2e on entries <= 1, the
  same count as the upload (scale 1);
- the GM's logits s cos(feature, W^{t+1}): the unit feature and s equal theirs to FLOAT64, so
  |s| times W^{t+1}'s error (scale |s|).

The scores (PM(L), PM(V), the GM's accuracy: argmax counts of the eval pass's float32 logits, one
rounding more) equal theirs as long as no probe sample's top two logits are within the logits'
tolerance: checked.
"""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conformance.common import FLOAT64, assert_matches, fingerprint, float32_roundings, load_fixture
from conformance.fednh import CLIENT_LABELS, NUM_CLASSES, OUR_NAMES, pixels_to_input
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.server import legacy_strategy
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, PM_L, PM_V
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fednh import (
    FedNHClient,
    FedNHStrategy,
    _orthonormal_columns,
    orthogonal_prototypes,
    update_prototypes,
)
from protofl.task.data import ClientData
from protofl.task.robust import robust_average_layers

pytestmark = pytest.mark.conformance

FEATURE_DIM = 192
# count x unit class mean of a client's upload, and W^{t+1} from those means (the docstring)
UPLOAD_ROUNDINGS = FEATURE_DIM + 18
# a fingerprint entry is an inner product with a fixed direction: weights that agree to FLOAT64's
# rtol (d <= rtol |w|) give entries that differ by about |d| <= rtol |w| (common.fingerprint), so
# compared relative to the weights' norm; the fingerprint's own float64 sums of N <= 6.2e5 terms
# (another BLAS kernel where the fixture was made) differ by about sqrt(N) u |g| |w| = N u |w|
# <= 7e-11 |w|, below that
FINGERPRINT = FLOAT64["rtol"]


def test_orthogonal_init_is_the_codes_qr_of_a_standard_normal_draw():
    fixture = load_fixture("fednh-orthogonal-init")
    theirs = fixture.outputs["prototypes"]
    # their orthogonal_(torch.rand(C, d)) ignores the uniform draw: QR of a fresh N(0, 1) draw
    # (d x C), signs fixed by R's diagonal; ours is the same factorisation
    assert_matches(_orthonormal_columns(fixture.outputs["qr_input"]).T, theirs, "the orthonormal rows")
    # ... of the same kind of draw: no prototype leans toward the non-negative orthant that the
    # ReLU features live in (a row of a QR of a uniform [0, 1) draw has cosine ~0.87 with it)
    toward_orthant = np.ones(192) / np.sqrt(192)
    assert np.abs(theirs @ toward_orthant).max() < 0.35
    for seed in range(3):
        assert np.abs(orthogonal_prototypes(10, 192, seed) @ toward_orthant).max() < 0.35


def test_server_step_equals_the_codes():
    fixture = load_fixture("fednh-server-aggregate")
    given, theirs = fixture.inputs, fixture.outputs
    ours = update_prototypes(given["prototypes"], given["client_means"], given["client_counts"], float(given["rho"]))
    assert_matches(ours, theirs["prototypes"], "W after the server step", **float32_roundings(1))  # returned as float32
    np.testing.assert_array_equal(ours[3], given["prototypes"][3])  # held by nobody: unchanged, as theirs
    clients = [[w, b] for w, b in zip(given["client_body_weight"], given["client_body_bias"])]
    body = robust_average_layers(clients, [1.0] * len(clients), "method")  # FedNH's unweighted mean
    assert_matches(body[0], theirs["body_weight"], "the averaged weight")
    assert_matches(body[1], theirs["body_bias"], "the averaged bias")


def _settings(fixture, tmp_path) -> ExperimentSettings:
    given = fixture.inputs
    fixed = bool(given["fix_scaling"])
    return ExperimentSettings(
        method="fednh", model="fednh-cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]),
        batch_size=64, lr=float(given["lr"]), lr_decay=float(given["lr_decay"]), momentum=float(given["momentum"]),
        weight_decay=float(given["weight_decay"]), max_grad_norm=float(given["max_grad_norm"]), amp="off",
        channels_last=False, test_fraction=0.0, global_test_pm=True, output_dir=str(tmp_path), run_name="conformance",
        options={"rho": float(given["rho"]), "prototype-init": "orthogonal", "learnable-scale": not fixed,
                 "scale": 30.0 if fixed else 1.0},
    )


def _data(fixture, partition_id: int, client: str) -> ClientData:
    given = fixture.inputs
    probe_x, probe_y = pixels_to_input(given["probe.pixels"]), torch.from_numpy(given["probe.labels"])
    return ClientData(partition_id, NUM_CLASSES, pixels_to_input(given[f"client_{client}.pixels"]),
                      torch.from_numpy(given[f"client_{client}.labels"]), probe_x, probe_y)


def _assert_fingerprint(array, expected, what):
    """``array``'s fingerprint equals ``expected`` to FINGERPRINT relative to its norm (entry 1)."""
    assert_matches(fingerprint(array), expected, what, rtol=0.0, atol=FINGERPRINT * expected[1])


def _assert_weights(model, theirs, prefix):
    state = model.state_dict()
    for their_name, our_name in OUR_NAMES.items():
        _assert_fingerprint(state[our_name].numpy(), theirs[f"{prefix}.{their_name}"], f"{prefix} {our_name}")


def _forward(model, x):
    """(features, logits) in eval mode, in the model's float64 (not the float32 of the eval pass,
    ``features_and_logits``)."""
    model.eval()
    with torch.no_grad():
        return model(x)


def _assert_no_near_ties(logits, tolerance, what):
    """An argmax that a change of the logits within ``tolerance`` cannot flip."""
    top = np.sort(np.asarray(logits), axis=1)[:, -2:]
    assert (top[:, 1] - top[:, 0] > 2 * (tolerance["atol"] + tolerance["rtol"] * np.abs(top).max())).all(), what


@pytest.fixture(params=["fednh-round-learnable-scale", "fednh-round-fixed-scale"])
def round_fixture(request):
    return load_fixture(request.param)


def test_first_step_loss_logits_and_gradients_equal_the_codes(round_fixture, tmp_path):
    theirs = round_fixture.outputs
    settings = _settings(round_fixture, tmp_path)
    data = _data(round_fixture, 0, "a")
    model = build_method_model(settings, data)
    _assert_weights(model, theirs, "initial")  # the same seeded init (torch.manual_seed(2022))
    model.head.prototypes.copy_(torch.from_numpy(theirs["initial.prototype"]))
    assert float(model.head.scale.detach()) == float(theirs["initial.scaling"].reshape(-1)[0])  # 1 (code) or 30 (paper)
    model.train()
    _, logits = model(data.train_x)
    loss = F.cross_entropy(logits, data.train_y)  # over all C classes, no masking (Eq. 2)
    loss.backward()
    assert_matches(logits.detach(), theirs["first_step.logits"], "the logits s cos(feature, W_c)")
    assert_matches(loss.detach(), theirs["first_step.loss"], "the loss")
    grads = {name: p.grad for name, p in model.named_parameters()}
    for their_name, our_name in OUR_NAMES.items():
        _assert_fingerprint(grads[our_name].numpy(), theirs[f"first_step.grad.{their_name}"],
                            f"the gradient of {our_name}")
    if "first_step.grad.scaling" in theirs:  # the code's learnable scale
        assert_matches(grads["head.scale"].reshape(1), theirs["first_step.grad.scaling"], "the gradient of s")
    else:
        assert "head.scale" not in grads  # s = 30 fixed: not trained


def test_one_round_clients_server_and_scores_equal_the_codes(round_fixture, tmp_path):
    theirs = round_fixture.outputs
    settings = _settings(round_fixture, tmp_path)
    server_round = int(round_fixture.inputs["round"])
    data = {k: _data(round_fixture, pid, k) for pid, k in enumerate(CLIENT_LABELS)}
    strategy = legacy_strategy(FedNHStrategy)(settings, build_method_model(settings, data["a"]), NUM_CLASSES,
                             global_test=(data["a"].test_x, data["a"].test_y))
    strategy.prototypes = theirs["initial.prototype"]  # their seeded orthogonal W^0
    start_round(strategy, range(len(data)))
    configs = strategy.round_configs(server_round, range(len(data)))
    sent = strategy.shared_weights()
    results = []
    for (pid, k), config in zip(enumerate(data), configs):
        client = FedNHClient(settings, data[k], build_method_model(settings, data[k]), len(data), RecordDict())
        arrays, n, metrics = client.fit(sent, config)
        _assert_weights(client.model, theirs, f"client_{k}")
        if settings.options["learnable-scale"]:
            assert_matches(client.model.head.scale.detach().reshape(1), theirs[f"client_{k}.scaling"], "the trained s")
        features, logits = _forward(client.model, data[k].train_x)
        assert_matches(F.normalize(features, dim=1), theirs[f"client_{k}.unit_features"], "unit features")
        assert_matches(logits, theirs[f"client_{k}.logits"], "trained logits")
        # the upload: theirs is count x normalise(class mean of unit features), counts with 1e-12
        # for absent classes; ours the class means and counts (the server normalises)
        means = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
        their_counts = theirs[f"client_{k}.counts"]
        np.testing.assert_array_equal(counts, np.where(their_counts >= 1, their_counts, 0))
        assert means.dtype == np.float32  # the wire's
        means = means.astype(np.float64)
        scaled = counts[:, None] * means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
        assert_matches(scaled, theirs[f"client_{k}.scaled_prototype"], "count x unit class mean",
                       **float32_roundings(UPLOAD_ROUNDINGS, scale=counts.max()))
        if k == "a":  # its personal model (trained body, the W it trained with) on the probe set
            _, _, scores = client.evaluate(sent, config)
            _, probe_logits = _forward(client.model, data[k].test_x)  # equal to theirs to FLOAT64
            _assert_no_near_ties(probe_logits, float32_roundings(1, scale=float(probe_logits.abs().max())),
                                 "a PM logit's top two within the eval pass's float32 rounding")
            assert scores[PM_L] == pytest.approx(float(theirs["client_a.pm_l"]))
            assert scores[PM_V] == pytest.approx(float(theirs["client_a.pm_v"]))
        results.append((FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters(arrays), n, metrics)))

    parameters, _ = strategy.aggregate_fit(server_round, results, [])
    assert_matches(strategy.prototypes, theirs["global.prototype"], "W^{t+1}", **float32_roundings(UPLOAD_ROUNDINGS))
    untouched = [c for c in range(NUM_CLASSES) if c not in set(sum(CLIENT_LABELS.values(), []))]
    np.testing.assert_array_equal(strategy.prototypes[untouched], theirs["initial.prototype"][untouched])
    _, scores = strategy.evaluate(server_round, parameters)  # GM: the averaged body with W^{t+1}
    _assert_weights(strategy.model, theirs, "global")
    assert_matches(strategy.model.head.scale.detach().reshape(-1), theirs["global.scaling"].reshape(-1),
                   "the averaged s")
    _, gm_logits = _forward(strategy.model, data["a"].test_x)
    # s cos(feature, W^{t+1}): W^{t+1}'s tolerance times |s|
    through_w = float32_roundings(UPLOAD_ROUNDINGS, scale=float(np.abs(theirs["global.scaling"]).max()))
    assert_matches(gm_logits, theirs["global.probe_logits"], "the GM's logits", **through_w)
    _assert_no_near_ties(theirs["global.probe_logits"], through_w, "a GM logit's top two too close to compare")
    assert scores["global-accuracy"] == pytest.approx(float(theirs["global.accuracy"]))
    assert len(parameters_to_ndarrays(parameters)) == len(sent)
