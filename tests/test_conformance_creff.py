"""CReFF against numbers the implementation in FedNH's repository (Yutong-Dai/FedNH,
src/flbase/strategies/CReFF.py) computed on the same inputs.

The fixtures (tests/conformance/fixtures/fednh-creff-*.npz) and the calls that made them are
described in tests/conformance/fednh_creff.py; their code is not run here. Both sides compute in
float64 (tests/conformance/common.py) and nothing compared here is rounded to float32 on purpose
(the class gradients, W_syn and the federated features are in the model's dtype, float64 in these
tests), so every comparison is to ``FLOAT64``'s rtol, 1e-9 (derived in common.py: sums in another
order, cancelling at most 100-fold, a few SGD steps amplifying at most 10-fold), with the absolute
part 1e-9 x the scale of the compared values (n u sum|terms| is the rounding bound):

- the class gradients (F^T (softmax - onehot) / n, averaged over 10 draws): 1e-9 x the largest
  entry. Theirs run the body on each class's batch, ours on the whole set: another order of the
  same float64 sums. An entry of a feature a ReLU zeroed is exactly 0 on both sides;
- the federated features after matching: their displacement from the start, 1e-9 x its largest
  entry (3 SGD steps; comparing the features themselves, of magnitude ~3, would hide a change of
  the ~1e-2 displacement). The features' own float64 rounding, 3 u |f| ~ 1e-15, is far below;
- the re-trained weight and bias (12 SGD steps of a linear classifier): 1e-9 x their largest entry;
- the FedAvg aggregate: the mean of two arrays, 1e-9 x the largest client entry.

Where the code's draws are random and ours draw from our own streams (the features' start, the
fresh classifier's init, the re-training's shuffles), the tests feed ours what theirs drew.
"""

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64, assert_matches, fingerprint, load_fixture, pixels_to_input
from conformance.fednh import OUR_NAMES
from conformance.fednh_creff import CLIENT_LABELS, NUM_CLASSES
from flwr.app import RecordDict
from torch import nn

import protofl.strategies.creff as creff
from protofl.federation.admission import ClientUpdate
from protofl.federation.server import legacy_strategy
from protofl.federation.wire import indexed
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.creff import (
    CLASS_GRADIENTS,
    GRADIENT_CLASSES,
    CReFFClient,
    CReFFStrategy,
    match_features,
    retrain_classifier,
)
from protofl.task.data import ClientData

pytestmark = pytest.mark.conformance

STATE = ("linear2.weight", "linear2.bias", "prototype.weight")  # the fixture's small state dict, in order


def _assert_scaled(actual, expected, what):
    """``actual`` (ours) equals ``expected`` (theirs) to FLOAT64's rtol, the absolute part 1e-9 x
    ``expected``'s largest entry (the docstring)."""
    scale = float(np.abs(expected).max())
    assert_matches(actual, expected, what, rtol=FLOAT64["rtol"], atol=FLOAT64["rtol"] * scale)


def _settings(tmp_path, seed=0, batch_size=64, **options) -> ExperimentSettings:
    return ExperimentSettings(
        method="creff", model="fednh-cnn", seed=seed, batch_size=batch_size, amp="off", channels_last=False,
        test_fraction=0.0, output_dir=str(tmp_path), run_name="conformance", options=options,
    )


def _data(given, partition_id, k) -> ClientData:
    x, y = pixels_to_input(given[f"client_{k}.pixels"]), torch.from_numpy(given[f"client_{k}.labels"])
    return ClientData(partition_id, NUM_CLASSES, x, y, x, y)


def test_client_class_gradients_equal_compute_real_feature_gradient(tmp_path):
    """Per class held, the mean over 10 batches of the cross-entropy's gradient w.r.t. W_syn at the
    features of the body received (their retrained_model: the body with W_syn as its head, in eval
    mode), zeros for a class not held. Each of their draws takes all of a class's samples
    (CReFF_batch_real >= every count), and so does each of ours (real-batch the same)."""
    fixture = load_fixture("fednh-creff-client-gradients")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(tmp_path, seed=int(given["init_seed"]), **{"real-batch": int(given["batch_real"]),
                                                                      "gradient-repeats": 10})
    w_syn = [torch.from_numpy(given["w_syn"])]
    for pid, k in enumerate(CLIENT_LABELS):
        assert np.bincount(given[f"client_{k}.labels"]).max() <= int(given["batch_real"])  # the order cannot matter
        data = _data(given, pid, k)
        client = CReFFClient(settings, data, build_method_model(settings, data), len(CLIENT_LABELS), RecordDict())
        state = client.model.state_dict()
        for their_name, our_name in OUR_NAMES.items():  # the body received: their seeded init (2022)
            expected = theirs[f"initial.{their_name}"]
            assert_matches(fingerprint(state[our_name].numpy()), expected, f"the body's {our_name}", rtol=0.0,
                           atol=FLOAT64["rtol"] * expected[1])
        (gradients,), held = client.class_gradients(w_syn, seed=0)
        np.testing.assert_array_equal(held, theirs[f"client_{k}.held"])
        _assert_scaled(gradients, theirs[f"client_{k}.gradients"], f"client {k}'s class gradients")
        np.testing.assert_array_equal(gradients[held == 0], 0.0)


def _real(given) -> dict[int, list[torch.Tensor]]:
    """The real gradient of each class some client sent: the unweighted mean over its holders."""
    gradients, held = given["client_gradients"], given["client_held"]
    return {c: [torch.from_numpy(gradients[held[:, c] == 1, c].mean(axis=0))]
            for c in range(NUM_CLASSES) if held[:, c].any()}


def test_match_features_equals_update_feature_syn():
    """Eq. 4-5: SGD steps of the features on sum_c D(their gradient, the real one), D per output
    row 1 - cos with 1e-6 added to the norms' product; class 3, sent by nobody, stays put."""
    fixture = load_fixture("fednh-creff-server")
    given, theirs = fixture.inputs, fixture.outputs
    start = torch.from_numpy(given["features"])
    ours = match_features(start, [torch.from_numpy(given["w_syn"])], _real(given), int(given["match_epochs"]),
                          float(given["feature_lr"])).numpy()
    assert np.abs(theirs["features"] - given["features"]).max() > 1e-3  # the steps moved them
    _assert_scaled(ours - given["features"], theirs["features"] - given["features"], "the features' displacement")
    np.testing.assert_array_equal(ours[3], given["features"][3])
    np.testing.assert_array_equal(theirs["features"][3], given["features"][3])


def _their_classifier(given) -> nn.Linear:
    """A fresh Linear (with bias, as feature_re_train's) holding their initial values."""
    classifier = nn.Linear(given["initial_weight"].shape[1], NUM_CLASSES, dtype=torch.float64)
    with torch.no_grad():
        classifier.weight.copy_(torch.from_numpy(given["initial_weight"]))
        classifier.bias.copy_(torch.from_numpy(given["initial_bias"]))
    return classifier


def test_retrain_classifier_equals_feature_re_train():
    """Eq. 6: epochs of mini-batch SGD of a fresh Linear with bias on the matched features (in their
    loader's orders; the last batch of each epoch smaller: 20 = 8 + 8 + 4)."""
    fixture = load_fixture("fednh-creff-server")
    given, theirs = fixture.inputs, fixture.outputs
    retrained = retrain_classifier(_their_classifier(given), torch.from_numpy(theirs["features"]),
                                   int(given["retrain_epochs"]), float(given["classifier_lr"]),
                                   int(given["batch_size"]), iter(torch.from_numpy(given["orders"])))
    _assert_scaled(retrained.weight.detach(), theirs["weight"], "the re-trained weight")
    _assert_scaled(retrained.bias.detach(), theirs["bias"], "the re-trained bias")


def test_server_round_equals_aggregate_update_feature_syn_and_feature_re_train(tmp_path, monkeypatch):
    """The strategy's whole step: FedAvg unweighted (``weighted = false``; the clients' sizes differ,
    their aggregate is the plain mean), each class's real gradient the mean over the clients that
    sent it, the matched features kept, the re-trained weight the next W_syn and GM's head (their
    retrained_full_model_params: the aggregate with prototype.weight replaced), the bias dropped."""
    fixture = load_fixture("fednh-creff-server")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(tmp_path, batch_size=int(given["batch_size"]), **{
        "weighted": False, "features-per-class": given["features"].shape[1],
        "match-epochs": int(given["match_epochs"]), "feature-lr": float(given["feature_lr"]),
        "retrain-epochs": int(given["retrain_epochs"]), "classifier-lr": float(given["classifier_lr"])})
    data = ClientData(0, NUM_CLASSES, torch.zeros(2, 3, 32, 32), torch.arange(2), torch.zeros(2, 3, 32, 32),
                      torch.arange(2))
    strategy = legacy_strategy(CReFFStrategy)(settings, build_method_model(settings, data), NUM_CLASSES)
    strategy.federated_features = given["features"].copy()
    strategy.classifier = [given["w_syn"].copy()]
    strategy.admission.sent_parameters = [given[f"server.{name}"] for name in STATE]

    def their_draws(classifier, features, epochs, lr, batch_size, orders):
        """Our retrain_classifier from their fresh Linear's values, in their loader's orders."""
        assert (epochs, lr, batch_size) == (int(given["retrain_epochs"]), float(given["classifier_lr"]),
                                            int(given["batch_size"]))
        assert classifier.bias is not None  # a fresh Linear with bias, as theirs
        with torch.no_grad():
            classifier.weight.copy_(torch.from_numpy(given["initial_weight"]))
            classifier.bias.copy_(torch.from_numpy(given["initial_bias"]))
        return retrain_classifier(classifier, features, epochs, lr, batch_size, iter(torch.from_numpy(given["orders"])))

    monkeypatch.setattr(creff, "retrain_classifier", their_draws)
    updates = []
    for i, n in enumerate(given["client_num_examples"]):
        uploads = indexed(CLASS_GRADIENTS, [given["client_gradients"][i]])
        uploads[GRADIENT_CLASSES] = given["client_held"][i].astype(np.float32)
        updates.append(ClientUpdate(i, int(n), [given[f"client_{i}.{name}"] for name in STATE], None, {}, uploads))
    assert given["client_num_examples"][0] != given["client_num_examples"][1]  # weighted would differ
    parameters = strategy.aggregate_updates(1, updates)
    for name, ours in zip(STATE, parameters):
        scale = max(np.abs(given[f"client_{i}.{name}"]).max() for i in range(len(updates)))
        assert_matches(ours, theirs[f"aggregate.{name}"], f"the aggregate {name}", atol=FLOAT64["rtol"] * scale)
    displacement = strategy.federated_features - given["features"]
    _assert_scaled(displacement, theirs["features"] - given["features"], "the kept features' displacement")
    (w_syn,) = strategy.classifier
    _assert_scaled(w_syn, theirs["weight"], "the next W_syn")
    _assert_scaled(w_syn, theirs["full.prototype.weight"], "GM's head")
    shared = strategy.shared_weights()
    gm = strategy.global_model_weights(shared)
    head = [i for i, name in enumerate(strategy.model.state_dict()) if name == "head.weight"]
    assert head == strategy.head_entries  # fednh-cnn's head: a weight without bias, as their prototype
    np.testing.assert_array_equal(gm[head[0]], w_syn)
    for i, (a, b) in enumerate(zip(gm, shared)):
        if i not in head:
            np.testing.assert_array_equal(a, b)
