"""FedProto against numbers two codes computed on the same inputs: PFLlib's (TsingZ0/PFLlib) and the
original authors' (yuetan031/FedProto).

The fixtures (tests/conformance/fixtures/fedproto-*.npz) and the calls that made them are described
in tests/conformance/fedproto.py; their code is not run here.

Where our defaults follow the paper and the codes differ, the switches reproduce the codes: both
average each class's prototypes unweighted over the clients that hold it (``weighting =
"uniform"``; the paper's Eq. 5 weights by counts), PFLlib takes the prototypes from the
training-mode features of every local epoch (``prototype-pass = "during-train"``), the original
from those of the last epoch only (``"last-epoch"``: it resets its collection each epoch).
Tolerances: averages to ``FLOAT32_REORDERING`` (rtol 1e-5); two rounds of the same network on the
same full batches to 2e-5 relative (measured on this CPU: at most 7e-8).
"""

import io

import numpy as np
import pytest
import torch
from conformance.common import assert_matches, fingerprint, load_fixture
from conformance.fedproto import NUM_CLASSES, OTHER_CLIENTS, OUR_NAMES, pixels_to_input
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters

from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, TRAIN_LOSS, ClassStatistics, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedproto import FedProtoClient, FedProtoStrategy
from protofl.task.data import ClientData
from protofl.task.train import features_and_logits

pytestmark = pytest.mark.conformance

TRAINED = {"rtol": 2e-5, "atol": 1e-6}


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
    strategy = FedProtoStrategy(settings, build_method_model(settings, data), NUM_CLASSES)
    start_round(strategy, range(len(uploads)))
    results = []
    for pid, (prototypes, counts) in enumerate(uploads):
        metrics = {"partition-id": pid, "train-loss": 1.0, **ClassStatistics(prototypes, counts).to_metrics()}
        results.append((FakeProxy(str(100 + pid)), FitRes(OK, ndarrays_to_parameters([]), int(counts.sum()), metrics)))
    _, metrics = strategy.aggregate_fit(1, results, [])
    assert metrics["accepted"] == len(uploads)
    return strategy


def _others(given) -> list[tuple[np.ndarray, np.ndarray]]:
    """The other clients' uploads, 3 samples of each class they hold (the counts do not weigh here)."""
    return [(given[f"client_{k}.prototypes"], np.isin(np.arange(NUM_CLASSES), classes) * 3)
            for k, classes in OTHER_CLIENTS.items()]


def _assert_weights(model, theirs, prefix, names=OUR_NAMES):
    state = model.state_dict()
    for their_name, our_name in names.items():
        expected = theirs[f"{prefix}.{their_name}"]
        assert_matches(fingerprint(state[our_name].numpy()), expected, f"{prefix} {our_name}", rtol=0.0,
                       atol=TRAINED["rtol"] * expected[1])


def test_pfllib_two_rounds_server_and_prototype_score_equal_the_codes(tmp_path):
    fixture = load_fixture("fedproto-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(given, tmp_path, **{"prototype-pass": "during-train"})
    data, state = _data(given), RecordDict()
    _assert_weights(build_method_model(settings, data), theirs, "initial")  # torch.manual_seed(0) for both
    strategy = _aggregate(settings, data, _others(given))  # P_c: the unweighted mean over holders
    np.testing.assert_array_equal(strategy.global_prototypes.mask, theirs["global.mask"])
    assert_matches(strategy.global_prototypes.vectors, theirs["global.prototypes"], "the global prototypes")
    broadcast = {k: encode_array(v) for k, v in strategy.broadcast(2).items()}
    for server_round in (1, 2):  # round 1: no global prototypes yet, CE only
        config = {"server-round": server_round, "seed": server_round} | (broadcast if server_round == 2 else {})
        client = FedProtoClient(settings, data, build_method_model(settings, data), 1, state)
        _, _, metrics = client.fit([], config)
        prefix = f"round{server_round}"
        _assert_weights(client.model, theirs, prefix)
        features, logits = features_and_logits(client.model, data.train_x)
        assert_matches(features, theirs[f"{prefix}.features"], f"{prefix} features", **TRAINED)
        assert_matches(logits, theirs[f"{prefix}.logits"], f"{prefix} logits", **TRAINED)
        prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        np.testing.assert_array_equal(np.load(io.BytesIO(metrics[CLASS_COUNTS])) > 0, theirs[f"{prefix}.mask"])
        assert_matches(prototypes, theirs[f"{prefix}.prototypes"], f"{prefix} prototypes", **TRAINED)
    evaluator = FedProtoClient(settings, data, build_method_model(settings, data), 1, state)
    _, tested, scores = evaluator.evaluate([], {"server-round": 2, "seed": 2} | broadcast)
    assert tested == int(theirs["probe.tested"])
    assert scores["correct-prototype"] == int(theirs["probe.correct"])  # nearest global prototype


def test_original_round_and_server_equal_the_codes(tmp_path):
    fixture = load_fixture("fedproto-original-round")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(given, tmp_path, **{"prototype-pass": "last-epoch"})
    data = _data(given)
    model = build_method_model(settings, data)
    _assert_weights(model, theirs, "initial", {name: name for name in OUR_NAMES.values()})
    global_prototypes = _aggregate(settings, data, _others(given)).broadcast(1)
    np.testing.assert_array_equal(global_prototypes["global-prototypes-mask"].astype(bool), given["global.mask"])
    config = {"server-round": 1, "seed": 1} | {k: encode_array(v) for k, v in global_prototypes.items()}
    state = RecordDict()
    _, _, metrics = FedProtoClient(settings, data, model, 1, state).fit([], config)
    _assert_weights(model, theirs, "trained", {name: name for name in OUR_NAMES.values()})
    # the mean over the steps of CE + ld * MSE(feature, global prototype), classes without one masked
    assert metrics[TRAIN_LOSS] == pytest.approx(float(theirs["loss.total"]), rel=1e-5)
    prototypes = np.load(io.BytesIO(metrics[CLASS_MEANS]))
    counts = np.load(io.BytesIO(metrics[CLASS_COUNTS]))
    np.testing.assert_array_equal(counts > 0, theirs["mask"])
    assert_matches(prototypes, theirs["prototypes"], "the last epoch's prototypes", **TRAINED)
    # their score: the nearest global prototype among the client's own classes ("own")
    config = {"server-round": 1, "seed": 1} | {k: encode_array(v) for k, v in global_prototypes.items()}
    own = _settings(given, tmp_path, **{"prototype-pass": "last-epoch", "prototype-classes": "own"})
    _, _, scores = FedProtoClient(own, data, build_method_model(own, data), 1, state).evaluate([], config)
    assert scores["correct-prototype"] == int(theirs["probe.prototype_correct"])
    # the switch: class 1's prototype placed on the first probe feature; this client holds no class 1
    predicted = {}
    for classes in ("own", "all"):
        switched = _settings(given, tmp_path, **{"prototype-pass": "last-epoch", "prototype-classes": classes})
        client = FedProtoClient(switched, data, build_method_model(switched, data), 1, state)
        client.prepare_evaluation([], config)
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
                   **TRAINED)
