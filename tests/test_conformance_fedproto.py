"""FedProto against numbers two codes computed on the same inputs: PFLlib's (TsingZ0/PFLlib) and the
original authors' (yuetan031/FedProto).

The fixtures (tests/conformance/fixtures/fedproto-*.npz) and the calls that made them are described
in tests/conformance/fedproto.py; their code is not run here.

Where our defaults follow the paper and the codes differ, the switches reproduce the codes: both
average each class's prototypes unweighted over the clients that hold it (``weighting =
"uniform"``; the paper's Eq. 5 weights by counts), PFLlib takes the prototypes from the
training-mode features of every local epoch (``prototype-pass = "during-train"``), the original
from those of the last epoch only (``"last-epoch"``: it resets its collection each epoch).

Both sides compute in float64 (tests/conftest.py, make_fixtures.py), so one formula agrees to
``FLOAT64`` (rtol 1e-9, derived in tests/conformance/common.py): the initial and trained weights
(their fingerprints, to 1e-9 of the array's norm: a difference d moves each projection by about
|d|), the trained model's forward pass (run here in float64, not through the eval pass's float32
outputs), the training loss. The global prototypes a client trains with are given to both sides as
the same float32 values (their aggregate rounded as our wire rounds it, ``over_our_wire``), so
training itself sees no rounding. What protofl rounds to float32 on purpose is compared with
``float32_roundings(count, scale)`` (2^-24 relative per rounding), ``scale`` the largest entry
compared; every vector here is >= 0 (ReLU features, the seeded uploads), so no mean cancels and
each rounding stays within 2^-24 of the entry it lands in:

- a client's uploaded class means: 1 rounding (its float64 means -> the wire's float32);
- our server's global prototypes of float32 uploads: 1 (its float64 mean -> float32);
- our server's aggregate of our client's upload and the two others': 2 (the upload's, which
  moves the mean by at most 2^-24 of it since every term is >= 0, and the aggregate's).

The prototype scores are counts of nearest prototypes, ours from the eval pass's float32 features:
equal as long as no probe sample is within a float32 rounding of a tie (the nearest and second
nearest prototype differ by 17% or more of the distance here).
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64, assert_matches, fingerprint, float32_roundings, load_fixture
from conformance.fedproto import NUM_CLASSES, OTHER_CLIENTS, OUR_NAMES, over_our_wire, pixels_to_input
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters

from protofl.federation.server import legacy_strategy
from protofl.federation.wire import (
    CLASS_COUNTS,
    CLASS_MEANS,
    GLOBAL_PROTOTYPES,
    TRAIN_LOSS,
    ClassStatistics,
    ClassVectors,
    encode_array,
)
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedproto import FedProtoClient, FedProtoStrategy
from protofl.task.data import ClientData

pytestmark = pytest.mark.conformance


def _settings(given, tmp_path, **options) -> ExperimentSettings:
    return ExperimentSettings(
        method="fedproto", model="cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]),
        batch_size=64, lr=float(given["lr"]), momentum=float(given.get("momentum", 0.0)), amp="off",
        channels_last=False, output_dir=str(tmp_path), run_name="conformance",
        options={"lambda": float(given["lambda"]), "weighting": "uniform"} | options,
    )


def _data(given) -> ClientData:
    return ClientData(0, NUM_CLASSES, pixels_to_input(given["train.pixels"]), torch.from_numpy(given["train.labels"]),
                      pixels_to_input(given["probe.pixels"]), torch.from_numpy(given["probe.labels"]))


def _aggregate(settings, data, uploads: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Our server on the clients' (prototypes, counts): the global prototypes it broadcasts."""
    strategy = legacy_strategy(FedProtoStrategy)(settings, build_method_model(settings, data), NUM_CLASSES)
    start_round(strategy, range(len(uploads)))
    results = []
    for pid, (prototypes, counts) in enumerate(uploads):
        metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(prototypes, counts).to_metrics()}
        results.append((FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters([]), int(counts.sum()), metrics)))
    _, metrics = strategy.aggregate_fit(1, results, [])
    assert metrics["accepted"] == len(uploads)
    return strategy


def _config(server_round: int, prototypes: np.ndarray, mask: np.ndarray) -> dict:
    """A round's config with these global prototypes (float32: what our wire carries)."""
    arrays = ClassVectors(prototypes, mask).to_config(GLOBAL_PROTOTYPES)
    return {"server-round": server_round, "seed": server_round} | {k: encode_array(v) for k, v in arrays.items()}


def _roundings(count: int, expected: np.ndarray) -> dict[str, float]:
    """``count`` float32 roundings of ours on values up to the largest of ``expected``."""
    return float32_roundings(count, float(np.max(np.abs(expected))))


def _forward(model, x):
    """(features, logits) of the model in eval mode, in its dtype (float64 here: no rounding)."""
    model.eval()
    with torch.no_grad():
        return model(x)


def _others(given) -> list[tuple[np.ndarray, np.ndarray]]:
    """The other clients' uploads, 3 and 7 samples of each class they hold: unequal, so that weighting
    by counts would differ from the codes' unweighted mean."""
    return [(given[f"client_{k}.prototypes"], np.isin(np.arange(NUM_CLASSES), classes) * size)
            for size, (k, classes) in zip((3, 7), OTHER_CLIENTS.items())]


def _assert_weights(model, theirs, prefix, names=OUR_NAMES):
    state = model.state_dict()
    for their_name, our_name in names.items():
        expected = theirs[f"{prefix}.{their_name}"]
        assert_matches(fingerprint(state[our_name].numpy()), expected, f"{prefix} {our_name}", rtol=0.0,
                       atol=FLOAT64["rtol"] * expected[1])  # relative to the array's norm


def test_pfllib_two_rounds_server_and_prototype_score_equal_the_codes(tmp_path):
    fixture = load_fixture("fedproto-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(given, tmp_path, **{"prototype-pass": "during-train"})
    data, state = _data(given), RecordDict()
    _assert_weights(build_method_model(settings, data), theirs, "initial")  # torch.manual_seed(0) for both
    strategy = _aggregate(settings, data, _others(given))  # P_c: the unweighted mean over holders
    np.testing.assert_array_equal(strategy.global_prototypes.mask, theirs["global.mask"])
    assert_matches(strategy.global_prototypes.vectors, theirs["global.prototypes"], "the global prototypes",
                   **_roundings(1, theirs["global.prototypes"]))  # our server's float32
    # round 2 trains with what their client was given: their aggregate rounded as our wire rounds it
    sent = _config(2, over_our_wire(theirs["global.prototypes"]), theirs["global.mask"])
    for server_round in (1, 2):  # round 1: no global prototypes yet, CE only
        config = {"server-round": server_round, "seed": server_round} if server_round == 1 else sent
        client = FedProtoClient(settings, data, build_method_model(settings, data), 1, state)
        _, _, metrics = client.fit([], config)
        prefix = f"round{server_round}"
        _assert_weights(client.model, theirs, prefix)
        features, logits = _forward(client.model, data.train_x)
        assert_matches(features, theirs[f"{prefix}.features"], f"{prefix} features")
        assert_matches(logits, theirs[f"{prefix}.logits"], f"{prefix} logits")
        prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        assert prototypes.dtype == np.float32  # the wire's
        np.testing.assert_array_equal(np.load(io.BytesIO(metrics[CLASS_COUNTS])) > 0, theirs[f"{prefix}.mask"])
        assert_matches(prototypes, theirs[f"{prefix}.prototypes"], f"{prefix} prototypes",
                       **_roundings(1, theirs[f"{prefix}.prototypes"]))  # the upload's float32
    evaluator = FedProtoClient(settings, data, build_method_model(settings, data), 1, state)
    _, tested, scores = evaluator.evaluate([], sent)
    assert tested == int(theirs["probe.tested"])
    assert scores["correct-prototype"] == int(theirs["probe.correct"])  # nearest global prototype


def test_original_round_and_server_equal_the_codes(tmp_path):
    fixture = load_fixture("fedproto-original-round")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(given, tmp_path, **{"prototype-pass": "last-epoch"})
    data = _data(given)
    model = build_method_model(settings, data)
    _assert_weights(model, theirs, "initial", {name: name for name in OUR_NAMES.values()})
    config = _config(1, given["global.prototypes"], given["global.mask"])  # float32 for both
    state = RecordDict()
    _, _, metrics = FedProtoClient(settings, data, model, 1, state).fit([], config)
    _assert_weights(model, theirs, "trained", {name: name for name in OUR_NAMES.values()})
    # the mean over the steps of CE + ld * MSE(feature, global prototype), classes without one masked
    assert_matches(metrics[TRAIN_LOSS], theirs["loss.total"], "the training loss")
    prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    np.testing.assert_array_equal(counts > 0, theirs["mask"])
    assert_matches(prototypes, theirs["prototypes"], "the last epoch's prototypes",
                   **_roundings(1, theirs["prototypes"]))  # the upload's float32
    # their score: the nearest global prototype among the client's own classes ("own")
    own = _settings(given, tmp_path, **{"prototype-pass": "last-epoch", "prototype-classes": "own"})
    _, _, scores = FedProtoClient(own, data, build_method_model(own, data), 1, state).evaluate([], config)
    assert scores["correct-prototype"] == int(theirs["probe.prototype_correct"])
    # the switch: class 1's prototype placed on the first probe feature; this client holds no class 1
    predicted = {}
    for classes in ("own", "all"):
        switched = _settings(given, tmp_path, **{"prototype-pass": "last-epoch", "prototype-classes": classes})
        client = FedProtoClient(switched, data, build_method_model(switched, data), 1, state)
        client.prepare_evaluation([], client.round_of(config))
        features, logits = client.forward(data.test_x)
        vectors, mask = client.received_prototypes
        vectors = vectors.clone()
        vectors[1] = features[0]
        client.received_prototypes = (vectors, mask)
        predicted[classes] = client.predictors()["prototype"](features, logits)
    assert predicted["all"][0] == 1 and predicted["own"][0] != 1
    assert torch.isin(predicted["own"], torch.from_numpy(np.unique(given["train.labels"]))).all()
    strategy = _aggregate(settings, data, [(prototypes, counts), *_others(given)])
    np.testing.assert_array_equal(strategy.global_prototypes.mask, theirs["aggregated.mask"])
    assert_matches(strategy.global_prototypes.vectors, theirs["aggregated.prototypes"], "the aggregated prototypes",
                   **_roundings(2, theirs["aggregated.prototypes"]))  # the upload's and the aggregate's float32
