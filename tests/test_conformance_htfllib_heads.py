"""LG-FedAvg, FedDistill, FedTGP, FedGH and FedGen against numbers HtFLlib's code (TsingZ0/HtFLlib,
``system/flcore``) computed on the same inputs: one server step of each, and one local round of
FedGH's, FedTGP's, FedDistill's and FedGen's clients.

The fixtures (tests/conformance/fixtures/htfllib-*.npz) and the calls that made them are described
in tests/conformance/htfllib_heads.py; their code is not run here. Ours is called on the same
inputs: our pure functions (``prototype_pairs``, ``train_head``, ``adaptive_margin``,
``train_prototypes``, ``prototype_loss``, ``distillation_loss``, ``aggregate_prototypes``,
``Generator``, ``ensemble_loss``) and, for the server steps, our strategies' ``aggregate_updates``
(built for protofl's ``cnn``, whose 512-d features are the fixtures' servers' size, or, for FedTGP,
``fednh-cnn``, 192-d) on ``ClientUpdate``s. A client's local round is ours as our training loop runs
it (plain SGD on cross-entropy + the method's ``batch_loss``, the batches in the loader's order),
written out here with the function its ``batch_loss`` calls, on the fixtures' small ``SplitNet``;
and each of those clients is also run as protofl's own class (``FedGHClient``, ``FedTGPClient``,
``FedDistillClient``, ``FedGenClient``) through ``fit`` (:func:`_client_fit`): the parameters and the
server's broadcasts encoded as the wire encodes them, the data handed over permuted so that our
loop's seeded order gives their loader's batches, and what ``fit`` returns (the trained model, the
training loss, the shared entries, the class statistics and uploads) compared with theirs. Where
their code draws (the order of the server's pairs each epoch, FedGen's labels and noise) ours
is fed what theirs drew.

Their pairs come in their order (the clients in their ``random.sample``'s or selection's order,
each client's classes in its dict's, not ascending), ours client by client, class by class: the
tests check they are the same set of pairs (exactly), and translate each of their epoch's orders
into ours (``order -> position[order]``, ``position``: the index in our list of each of their
pairs), so that both visit the same pairs in the same batches.

Tolerances. Both sides compute in float64 (tests/conftest.py, make_fixtures.py), so one formula
agrees to ``FLOAT64``'s rtol, 1e-9 (derived in tests/conformance/common.py: sums in another order,
cancelling at most 100-fold, a few SGD or Adam steps amplifying at most 10-fold), with the absolute
part 1e-9 x the scale of the terms (n u sum|terms| is the rounding bound):

- averages (LG-FedAvg's and FedGen's heads): 1e-9 x the largest client entry;
- a trained tensor: 1e-9 x the largest entry of it or of its displacement, whichever is larger
  (comparing a displacement with the weights' own scale would hide a change of the ~1e-2 steps);
  FedTGP's 192 x 192 weights through their fingerprints, 1e-9 x the norm of the displacement (a
  difference d moves each projection by about |d|); FedGen's bias before the BatchNorm, whose
  gradient is 0 but for rounding noise that Adam's 1 / (sqrt(v) + 1e-8) magnifies, to
  steps x lr x 1e-7 (:func:`_assert_generator`);
- a loss or a margin (a scalar): FLOAT64;
- what protofl rounds to float32 on purpose (class means, per-class mean logits and FedTGP's global
  prototypes, the wire's dtype): one float32 rounding (``float32_roundings(1, scale)``, 6e-8
  relative). The fixtures' uploaded prototypes (FedGH, FedTGP: multiples of 1/16, each FedTGP class
  held by at most two clients) and logits (FedDistill: float32 values) are exact in float32, so the
  float32 uploads change nothing and FedTGP's class means (which set the margin) are exact;
  FedDistill's global logits are a float32 rounding of their float64 means. The targets the
  FedTGP and FedDistill client fixtures were made with are float32 values (the latter the rounding
  our server sends), so our clients receive exactly theirs through the float32 wire and their
  rounds compare at FLOAT64.

Each hand-written test also checks that a deliberately wrong setting (an untranslated order,
margin 0, the softmax target, the count weighting, the generator's eval mode) moves the result by
far more than the tolerance; the client runs compare with the same numbers at the same
tolerances.

Where HtFLlib's code does not do what it means to (tests/conformance/htfllib_heads.py), ours is
compared with what it computes and the difference is stated: their FedTGP client uploads the
prototypes of the model the round started from (ours by default: the trained model's, far from
theirs; ``fedtgp.prototype-model = "round-start"`` uploads theirs); their
FedGen server never saves the generator it trains (each round trains the initial one again and the
clients use the initial one; ours keeps it), so only one ``train_generator`` call is compared.
"""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conformance.common import FLOAT64, assert_matches, fingerprint, float32_roundings, load_fixture
from conformance.htfllib_heads import GENERATOR_NAMES, NUM_CLASSES, SMALL_DIM, TGP_CLASSES, split_net
from conformance.pfllib_baselines import batch_order
from torch import nn

import protofl.strategies.fedgen as fedgen
import protofl.strategies.fedgh as fedgh
import protofl.strategies.fedtgp as fedtgp
from protofl.federation.admission import ClientUpdate
from protofl.federation.wire import (
    CLASS_COUNTS,
    CLASS_MEANS,
    GLOBAL_PROTOTYPES,
    TRAIN_LOSS,
    ClassStatistics,
    ClassVectors,
    encode_array,
    indexed,
)
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.feddistill import distillation_loss
from protofl.strategies.fedgen import (
    GENERATOR,
    LABEL_COUNTS,
    LABEL_DISTRIBUTION,
    Generator,
    ensemble_loss,
    generator_entries,
)
from protofl.strategies.fedgh import train_head
from protofl.strategies.fedtgp import TrainablePrototypes, adaptive_margin, train_prototypes
from protofl.task.data import ClientData
from protofl.task.losses import prototype_loss
from protofl.task.models import SplitModel
from protofl.task.prototypes import aggregate_prototypes, prototype_pairs
from protofl.task.statistics import FeatureSums, class_means

pytestmark = pytest.mark.conformance


# --- helpers ------------------------------------------------------------------------------------

def _scaled(actual, expected, what, scale=None):
    """``actual`` (ours) equals ``expected`` (theirs) to FLOAT64's rtol, the absolute part 1e-9 x
    ``scale`` (default: ``expected``'s largest entry)."""
    scale = float(np.abs(expected).max()) if scale is None else scale
    assert_matches(actual, expected, what, rtol=FLOAT64["rtol"], atol=FLOAT64["rtol"] * scale)


def _trained(actual, expected, initial, what):
    """A trained tensor, to 1e-9 of the larger of its largest entry and its displacement's."""
    scale = max(float(np.abs(expected).max()), float(np.abs(np.asarray(expected) - initial).max()))
    _scaled(actual, expected, what, scale)
    return scale


def _far(actual, expected, scale) -> float:
    """How many tolerances (1e-9 x ``scale`` + 1e-9 x |expected|) apart ``actual`` is."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected) / (FLOAT64["rtol"] * (scale + np.abs(expected)))))


MODELS = {"cnn": (1, 16), "fednh-cnn": (3, 32)}  # protofl's model -> its inputs' channels and size


def _strategy(method, tmp_path, classes=NUM_CLASSES, batch_size=4, model="cnn", **options):
    """Our server of ``method`` for protofl's ``model`` (``cnn``: 512-d features, a Linear(512, C)
    head; ``fednh-cnn``: 192-d features)."""
    settings = ExperimentSettings(method=method, model=model, seed=0, batch_size=batch_size, amp="off",
                                  channels_last=False, output_dir=str(tmp_path), run_name="conformance",
                                  options=options)
    channels, size = MODELS[model]
    images = torch.zeros(2, channels, size, size)
    data = ClientData(0, classes, images, torch.arange(2), images, torch.arange(2))
    strategy = get_method(method)[0](settings, build_method_model(settings, data), classes)
    names = list(strategy.model.state_dict())
    return strategy, [names[i] for i in strategy.shared_indices]


def _pairs(given):
    """Our pairs (prototype_pairs), and the position in our list of each of their pairs."""
    prototypes, labels = prototype_pairs(given["means"], given["counts"])
    clients, classes = np.nonzero(given["counts"] > 0)
    position = {(int(k), int(c)): i for i, (k, c) in enumerate(zip(clients, classes))}
    theirs = [position[(int(k), int(c))] for k, c in zip(given["pair_clients"], given["pair_classes"])]
    return prototypes, labels, np.array(theirs)


def _our_orders(given, position):
    """Their epochs' orders (indices into their pair list) as indices into ours."""
    return [torch.from_numpy(position[order]) for order in given["orders"]]


def _statistics(given, k) -> ClassStatistics:
    """Client k's class statistics as they come off our wire (float32 means)."""
    means = given["means"][k].astype(np.float32)
    np.testing.assert_array_equal(means, given["means"][k])  # the fixture's values are exact in float32
    return ClassStatistics(means, given["counts"][k])


def _batches(given):
    x, y, b = torch.from_numpy(given["x"]), torch.from_numpy(given["y"]), int(given["batch_size"])
    return [(x[s:s + b], y[s:s + b]) for s in range(0, len(y) - b + 1, b)]  # their drop_last, shuffle=False


def _assert_trained_net(net, given, theirs):
    for name, tensor in net.state_dict().items():
        _trained(tensor.detach().numpy(), theirs[f"trained.{name}"], given[f"model.{name}"], f"the trained {name}")


ROUND_SEED = 3  # the round's seed in our clients' configs: our loop's batch order (torch.randperm of it)


def _client_fit(method, given, tmp_path, options, parameters, broadcasts):
    """protofl's own client of ``method`` (``get_method``'s class) through ``fit``, as a round-1
    message reaches it: the run settings of their client (one epoch, their batch size and
    learning rate, plain SGD, the trailing partial batch dropped), the fixture's SplitNet as our
    SplitModel (``base`` -> ``body``), ``parameters`` on the parameters channel and the server's
    ``broadcasts`` encoded as the wire encodes them. The data is handed over permuted so that our
    loop's batches (the permutation of ``ROUND_SEED``) are their loader's, x[0:4], x[4:8], ...
    (shuffle=False), in the same order within each batch. Returns (client, arrays, metrics)."""
    x, y = given["x"], given["y"]
    order = batch_order(len(y), ROUND_SEED)
    assert (order != np.arange(len(y))).any()  # (the permutation matters)
    x_ours, y_ours = np.empty_like(x), np.empty_like(y)
    x_ours[order], y_ours[order] = x, y
    settings = ExperimentSettings(method=method, seed=0, local_epochs=1, batch_size=int(given["batch_size"]),
                                  partial_batch="drop", lr=float(given["local_learning_rate"]), amp="off",
                                  channels_last=False, cuda_graphs="off", batchnorm_stats="running",
                                  output_dir=str(tmp_path), run_name="conformance", options=options)
    assert settings.round_lr(1) == float(given["local_learning_rate"])
    assert (settings.momentum, settings.weight_decay) == (0.0, 0.0)  # their torch.optim.SGD(lr)
    net = split_net(given)
    inputs, labels = torch.from_numpy(x_ours), torch.from_numpy(y_ours)
    client = get_method(method)[1](settings, ClientData(0, NUM_CLASSES, inputs, labels, inputs, labels),
                                   SplitModel(net.base, net.head, SMALL_DIM), 1, {})
    config = {"server-round": 1, "seed": ROUND_SEED} | {k: encode_array(v) for k, v in broadcasts.items()}
    arrays, num_examples, metrics = client.fit(parameters, config)
    assert num_examples == len(y)
    return client, arrays, metrics


def _assert_trained_client(client, given, theirs, starts=None):
    """Our client's model after fit against their trained model (``body`` -> ``base``), the scale
    of each entry's displacement from where it started (``starts``: by their name; default the
    fixture's ``model``)."""
    for name, tensor in client.model.state_dict().items():
        theirs_name = name.replace("body.", "base.", 1)
        start = (starts or {}).get(theirs_name, given[f"model.{theirs_name}"])
        _trained(tensor.detach().numpy(), theirs[f"trained.{theirs_name}"], start,
                 f"our client's trained {theirs_name}")


def _uploaded(metrics, key):
    return np.load(io.BytesIO(metrics[key]))


# --- LG-FedAvg ----------------------------------------------------------------------------------

def test_lgfedavg_head_average_equals_aggregate_parameters(tmp_path):
    """The heads averaged by training size (their uploaded_weights: train_samples / total), the
    body not shared."""
    fixture = load_fixture("htfllib-lgfedavg-server")
    given, theirs = fixture.inputs, fixture.outputs
    sizes = given["sizes"]
    np.testing.assert_allclose(theirs["uploaded_weights"], sizes[theirs["uploaded_ids"]] / sizes.sum(), rtol=1e-15)
    strategy, names = _strategy("lgfedavg", tmp_path)
    assert names == ["head.weight", "head.bias"]
    strategy.admission.sent_parameters = strategy.shared_weights()
    updates = [ClientUpdate(i, int(n), [given[f"client{i}.weight"], given[f"client{i}.bias"]], None)
               for i, n in enumerate(sizes)]
    weight, bias = strategy.aggregate_updates(1, updates)
    for name, ours in (("weight", weight), ("bias", bias)):
        scale = max(np.abs(given[f"client{i}.{name}"]).max() for i in range(len(sizes)))
        _scaled(ours, theirs[name], f"the aggregate head.{name}", scale)
        unweighted = np.mean([given[f"client{i}.{name}"] for i in range(len(sizes))], axis=0)
        assert _far(unweighted, theirs[name], scale) > 1e6  # the plain mean is far off


# --- FedGH --------------------------------------------------------------------------------------

def test_fedgh_prototype_pairs_are_their_uploaded_pairs():
    """prototype_pairs gives the (prototype, class) pairs of receive_protos: the same set, exactly
    (theirs in another order: their clients in random.sample's order, classes in dict order)."""
    given, theirs = load_fixture("htfllib-fedgh-server").inputs, load_fixture("htfllib-fedgh-server").outputs
    prototypes, labels, position = _pairs(given)
    assert sorted(position.tolist()) == list(range(len(labels)))  # one to one
    assert (position != np.arange(len(labels))).any()  # (another order: the translation matters)
    np.testing.assert_array_equal(prototypes[position], theirs["prototypes"])
    np.testing.assert_array_equal(labels[position], theirs["labels"])


def test_fedgh_train_head_equals_train_head():
    """Eq. 5: SGD with cross-entropy of the head on the pairs, in their loader's batches (7 pairs in
    batches of 3: 3, 3, 1), epochs x steps from the head the server holds."""
    fixture = load_fixture("htfllib-fedgh-server")
    given, theirs = fixture.inputs, fixture.outputs
    prototypes, labels, position = _pairs(given)
    initial = {k: torch.from_numpy(given[f"initial.{k}"]) for k in ("weight", "bias")}

    def trained(orders):
        return train_head(nn.Linear(prototypes.shape[1], NUM_CLASSES), initial, torch.from_numpy(prototypes),
                          torch.from_numpy(labels), int(given["server_epochs"]),
                          float(given["server_learning_rate"]), int(given["batch_size"]), iter(orders))

    ours = trained(_our_orders(given, position))
    scale = _trained(ours["weight"], theirs["weight"], given["initial.weight"], "the trained head's weight")
    _trained(ours["bias"], theirs["bias"], given["initial.bias"], "the trained head's bias")
    untranslated = trained([torch.from_numpy(o) for o in given["orders"]])  # their indices into our list
    assert _far(untranslated["weight"], theirs["weight"], scale) > 1e6


def test_fedgh_strategy_step_equals_receive_protos_and_train_head(tmp_path, monkeypatch):
    """FedGHStrategy.aggregate_updates: the head it sent trained on the pairs of the clients' class
    statistics (server-epochs, server-lr, the run's batch size), its shuffles replaced by their orders."""
    fixture = load_fixture("htfllib-fedgh-server")
    given, theirs = fixture.inputs, fixture.outputs
    _, labels, position = _pairs(given)
    strategy, names = _strategy("fedgh", tmp_path, batch_size=int(given["batch_size"]),
                                **{"server-epochs": int(given["server_epochs"]),
                                   "server-lr": float(given["server_learning_rate"])})
    assert names == ["head.weight", "head.bias"]
    strategy.admission.sent_parameters = [given["initial.weight"], given["initial.bias"]]

    def their_orders(n, generator):
        assert n == len(labels)
        return iter(_our_orders(given, position))

    monkeypatch.setattr(fedgh, "shuffles", their_orders)
    updates = [ClientUpdate(k, int(n), list(strategy.admission.sent_parameters), _statistics(given, k))
               for k, n in enumerate(given["sizes"])]
    weight, bias = strategy.aggregate_updates(1, updates)
    _trained(weight, theirs["weight"], given["initial.weight"], "the server's trained head.weight")
    _trained(bias, theirs["bias"], given["initial.bias"], "the server's trained head.bias")


def test_fedgh_client_fit_equals_clientGH_train_and_collect_protos(tmp_path):
    """FedGHClient.fit (protofl's client, its options' defaults) against their round: the server's
    head loaded over the client's (their set_parameters; ours: the shared entries), SGD on
    cross-entropy, then the upload: the per-class means of an eval pass of the TRAINED body (their
    train saves the model before collect_protos loads it) and the class counts, our head on the
    parameters channel. The weights and the loss at FLOAT64; the means one float32 rounding (the
    wire's) from theirs. The received body's means (an upload taken before training) are checked
    to be over 1e3 of that tolerance from theirs: the test tells the two apart."""
    fixture = load_fixture("htfllib-fedgh-client")
    given, theirs = fixture.inputs, fixture.outputs
    head = [given["server_head.weight"], given["server_head.bias"]]
    client, arrays, metrics = _client_fit("fedgh", given, tmp_path, {}, head, {})
    received = {f"head.{k}": given[f"server_head.{k}"] for k in ("weight", "bias")}
    _assert_trained_client(client, given, theirs, received)
    assert len(arrays) == 2  # the shared entries: the trained head
    for (name, start), array in zip(received.items(), arrays):
        _trained(array, theirs[f"trained.{name}"], start, f"the uploaded {name}")
    assert_matches(metrics[TRAIN_LOSS], theirs["ce"].mean(), "the training loss (their CE per batch, averaged)")
    counts, means = _uploaded(metrics, CLASS_COUNTS), _uploaded(metrics, CLASS_MEANS)
    np.testing.assert_array_equal(counts, np.bincount(given["y"], minlength=NUM_CLASSES))
    held = theirs["held"]
    np.testing.assert_array_equal(counts > 0, held)  # class 2: no sample, no prototype
    tolerance = float32_roundings(1, float(np.abs(theirs["prototypes"]).max()))
    assert_matches(means[held], theirs["prototypes"][held], "the uploaded prototypes", **tolerance)
    with torch.no_grad():  # the body received (before training): not what they upload
        before, _ = class_means(split_net(given).base.eval()(torch.from_numpy(given["x"])),
                                torch.from_numpy(given["y"]), NUM_CLASSES)
    assert np.abs(before[held] - theirs["prototypes"][held]).max() > 1e3 * tolerance["atol"]


# --- FedTGP -------------------------------------------------------------------------------------

def test_fedtgp_margin_equals_receive_protos_gap():
    """Eq. 8: the class means, the unweighted mean over the uploaders (their proto_cluster; exact:
    the fixture's means of two multiples of 1/16); the margin, min(max_gap, threshold), each class's
    gap its distance to the nearest other mean, class 4 (uploaded by nobody) the smallest gap."""
    fixture = load_fixture("htfllib-fedtgp-server")
    given, theirs = fixture.inputs, fixture.outputs
    means, mask = aggregate_prototypes(given["means"].astype(np.float32), given["counts"], "uniform")
    np.testing.assert_array_equal(mask, theirs["held"])
    np.testing.assert_array_equal(means, theirs["class_means"])
    threshold = float(given["margin_threthold"])
    assert theirs["max_gap"] < threshold  # the margin is the largest gap
    margin = adaptive_margin(means, mask, threshold)
    assert_matches(margin, theirs["margin"], "the margin")
    np.testing.assert_array_equal(theirs["gap"][~theirs["held"]], theirs["min_gap"])  # (their class without a mean)
    assert _far(theirs["min_gap"], margin, 0.0) > 1e6  # the smallest gap is far off
    small = float(theirs["min_gap"]) / 2
    assert adaptive_margin(means, mask, small) == min(float(theirs["max_gap"]), small)


def _seeded_prototypes(given, theirs) -> TrainablePrototypes:
    """Ours, made after their seed: Embedding, Linear, Linear drawn in their order, the same values."""
    torch.manual_seed(int(given["tgp_seed"]))
    module = TrainablePrototypes(TGP_CLASSES, given["means"].shape[2])
    for name, tensor in module.state_dict().items():
        expected = theirs[f"initial.{name}"]
        assert_matches(fingerprint(tensor.numpy()), expected, f"the initial {name}", rtol=0.0,
                       atol=FLOAT64["rtol"] * expected[1])
    return module


def _assert_tgp(module, initial, theirs, what):
    for name, tensor in module.state_dict().items():
        expected = theirs[f"displacement.{name}"]
        assert_matches(fingerprint((tensor - initial[name]).numpy()), expected, f"{what} {name}'s displacement",
                       rtol=0.0, atol=FLOAT64["rtol"] * expected[1])


def test_fedtgp_train_prototypes_equals_update_TGP():
    """Eq. 7: SGD of the trainable prototypes on CE over -(||p - G_j|| + margin [j = y]) in their
    loader's batches, then every class's G_c in eval mode (their global_protos)."""
    fixture = load_fixture("htfllib-fedtgp-server")
    given, theirs = fixture.inputs, fixture.outputs
    prototypes, labels, position = _pairs(given)

    def trained(margin):
        module = _seeded_prototypes(given, theirs)
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        train_prototypes(module, torch.from_numpy(prototypes), torch.from_numpy(labels), margin,
                         int(given["server_epochs"]), float(given["local_learning_rate"]), int(given["batch_size"]),
                         iter(_our_orders(given, position)))
        return module, initial

    module, initial = trained(float(theirs["margin"]))
    _assert_tgp(module, initial, theirs, "the trained")
    with torch.no_grad():
        ours = module.eval()(torch.arange(TGP_CLASSES)).numpy()
    _scaled(ours, theirs["global_prototypes"], "the global prototypes")
    unmargined, _ = trained(0.0)
    expected = theirs["displacement.out.bias"]
    assert _far(fingerprint((unmargined.out.bias - initial["out.bias"]).detach().numpy()), expected, expected[1]) > 1e6


def test_fedtgp_strategy_step_equals_receive_protos_and_update_TGP(tmp_path, monkeypatch):
    """FedTGPStrategy.aggregate_updates: the margin from the clients' class statistics, the
    prototypes trained on their pairs (its shuffles replaced by their orders; server-lr = their
    local_learning_rate, which their server trains at), every class's G_c sent as a float32 global
    prototype."""
    fixture = load_fixture("htfllib-fedtgp-server")
    given, theirs = fixture.inputs, fixture.outputs
    _, labels, position = _pairs(given)
    strategy, names = _strategy("fedtgp", tmp_path, classes=TGP_CLASSES, batch_size=int(given["batch_size"]),
                                model="fednh-cnn", **{"server-epochs": int(given["server_epochs"]),
                                   "server-lr": float(given["local_learning_rate"]),
                                   "margin-threshold": float(given["margin_threthold"])})
    assert names == [] and strategy.feature_dim == given["means"].shape[2]  # nothing of the model is shared
    seeded = _seeded_prototypes(given, theirs)
    strategy.prototype_model.load_state_dict(seeded.state_dict())
    initial = {k: v.clone() for k, v in seeded.state_dict().items()}

    def their_orders(n, generator):
        assert n == len(labels)
        return iter(_our_orders(given, position))

    monkeypatch.setattr(fedtgp, "shuffles", their_orders)
    updates = [ClientUpdate(k, 10, [], _statistics(given, k)) for k in range(len(given["means"]))]
    assert strategy.aggregate_updates(1, updates) is None
    _assert_tgp(strategy.prototype_model, initial, theirs, "the server's")
    sent = strategy.global_prototypes
    assert sent.mask.all() and sent.vectors.dtype == np.float32
    scale = float(np.abs(theirs["global_prototypes"]).max())
    assert_matches(sent.vectors, theirs["global_prototypes"], "the global prototypes sent",
                   **float32_roundings(1, scale))


def test_fedtgp_client_round_equals_clientTGP_train():
    """The client's loss per batch, CE + lambda * prototype_loss (every class has a global
    prototype: their MSELoss(proto_new, rep) over B x d), the model after its SGD steps, and the
    prototypes: per-class means of an eval pass of the body (float32). Ours are the trained body's;
    theirs are the body's the round started from (their train calls collect_protos before it saves
    the trained model, and collect_protos loads the saved one): the test checks our class_means of
    that body's eval pass against their upload, and that the trained body's are far from it."""
    fixture = load_fixture("htfllib-fedtgp-client")
    given, theirs = fixture.inputs, fixture.outputs
    prototypes = torch.from_numpy(given["global_prototypes"])
    everywhere = torch.ones(NUM_CLASSES, dtype=torch.bool)

    def round_(lamda):
        net = split_net(given)
        optimizer = torch.optim.SGD(net.parameters(), lr=float(given["local_learning_rate"]))
        ce, losses = [], []
        for x, y in _batches(given):
            features = net.base(x)
            cross_entropy = F.cross_entropy(net.head(features), y)
            loss = cross_entropy + lamda * prototype_loss(features, y, prototypes, everywhere)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ce.append(cross_entropy.item())
            losses.append(loss.item())
        return net, np.array(ce), np.array(losses)

    net, ce, losses = round_(float(given["lamda"]))
    assert_matches(ce, theirs["ce"], "the cross-entropy per batch")
    assert_matches(losses, theirs["loss"], "the loss per batch")
    _assert_trained_net(net, given, theirs)

    def prototypes_of(body):
        with torch.no_grad():
            return class_means(body.eval()(torch.from_numpy(given["x"])), torch.from_numpy(given["y"]), NUM_CLASSES)

    tolerance = float32_roundings(1, float(np.abs(theirs["prototypes"]).max()))
    means, counts = prototypes_of(split_net(given).base)  # the body received (theirs: before training)
    np.testing.assert_array_equal(counts > 0, theirs["held"])
    assert_matches(means, theirs["prototypes"], "the uploaded prototypes", **tolerance)
    trained_means, _ = prototypes_of(net.base)  # ours: the trained body's
    assert np.abs(trained_means - theirs["prototypes"]).max() > 1e3 * tolerance["atol"]
    _, _, summed_over_d = round_(float(given["lamda"]) * given["global_prototypes"].shape[1])
    assert _far(summed_over_d, theirs["loss"], 0.0) > 1e6  # the MSE summed over d, not averaged


def test_fedtgp_client_fit_equals_clientTGP_train(tmp_path):
    """FedTGPClient.fit (protofl's client: PrototypeLossClient's receive and batch_loss) with
    their lambda, the global prototypes sent as our server sends them (every class, float32 on
    the wire; the fixture's are float32 values, so the client receives exactly theirs): the
    weights after the steps and the training loss (the mean of their per-batch CE + lambda MSE)
    at FLOAT64. The upload, the class means of an eval pass of the trained body, is compared with
    those of THEIR trained body derived here in float64 (one float32 rounding: the wire's), not
    with their upload, which is the received body's (the quirk the test above checks)."""
    fixture = load_fixture("htfllib-fedtgp-client")
    given, theirs = fixture.inputs, fixture.outputs
    sent = ClassVectors(given["global_prototypes"].astype(np.float32), np.ones(NUM_CLASSES, bool))
    np.testing.assert_array_equal(sent.vectors, given["global_prototypes"])  # float32 values: exact on the wire
    client, arrays, metrics = _client_fit("fedtgp", given, tmp_path, {"lambda": float(given["lamda"])}, [],
                                          sent.to_config(GLOBAL_PROTOTYPES))
    assert arrays == []  # nothing of the model is shared
    received, available = client.received_prototypes
    np.testing.assert_array_equal(received.numpy(), given["global_prototypes"])
    assert available.all()
    _assert_trained_client(client, given, theirs)
    assert_matches(metrics[TRAIN_LOSS], theirs["loss"].mean(), "the training loss (their per-batch total, averaged)")
    counts, means = _uploaded(metrics, CLASS_COUNTS), _uploaded(metrics, CLASS_MEANS)
    np.testing.assert_array_equal(counts, np.bincount(given["y"], minlength=NUM_CLASSES))
    with torch.no_grad():  # float64 (class_means would round to float32 already)
        features = split_net(theirs, "trained").base.eval()(torch.from_numpy(given["x"])).numpy()
    expected = np.stack([features[given["y"] == c].mean(axis=0) for c in range(NUM_CLASSES)])
    assert_matches(means, expected, "the uploaded prototypes (their trained body's class means)",
                   **float32_roundings(1, float(np.abs(expected).max())))


def test_fedtgp_client_in_htfllibs_form_uploads_clientTGPs_prototypes(tmp_path):
    """``prototype-model = "round-start"``: FedTGPClient.fit trains as above and uploads the class
    means of an eval pass of the body it started the round from: their upload (float32), the trained
    body's far from it."""
    fixture = load_fixture("htfllib-fedtgp-client")
    given, theirs = fixture.inputs, fixture.outputs
    sent = ClassVectors(given["global_prototypes"].astype(np.float32), np.ones(NUM_CLASSES, bool))
    tolerance = float32_roundings(1, float(np.abs(theirs["prototypes"]).max()))
    uploaded = {}
    for form in ("round-start", "trained"):
        client, _, metrics = _client_fit("fedtgp", given, tmp_path / form,
                                         {"lambda": float(given["lamda"]), "prototype-model": form}, [],
                                         sent.to_config(GLOBAL_PROTOTYPES))
        _assert_trained_client(client, given, theirs)  # the form changes what goes up, not the training
        uploaded[form] = _uploaded(metrics, CLASS_MEANS)
    assert_matches(uploaded["round-start"], theirs["prototypes"], "the uploaded prototypes", **tolerance)
    assert np.abs(uploaded["trained"] - theirs["prototypes"]).max() > 1e3 * tolerance["atol"]


# --- FedDistill ---------------------------------------------------------------------------------

def test_feddistill_global_logits_equal_proto_aggregation(tmp_path):
    """The global logit of a class: the unweighted mean of the uploaders' (their proto_aggregation),
    none for a class nobody uploaded; float32 (the wire's), by aggregate_prototypes and by the
    strategy (FedProto's server with the uniform weighting)."""
    fixture = load_fixture("htfllib-feddistill-server")
    given, theirs = fixture.inputs, fixture.outputs
    uploads = given["means"].astype(np.float32)
    np.testing.assert_array_equal(uploads, given["means"])  # float32 values: the wire changes nothing
    tolerance = float32_roundings(1, float(np.abs(theirs["global_logits"]).max()))
    logits, available = aggregate_prototypes(uploads, given["counts"], "uniform")
    np.testing.assert_array_equal(available, theirs["available"])
    assert_matches(logits, theirs["global_logits"], "the global logits", **tolerance)
    np.testing.assert_array_equal(logits[~available], 0.0)
    strategy, _ = _strategy("feddistill", tmp_path)
    updates = [ClientUpdate(k, int(c.sum()), [], ClassStatistics(uploads[k], c)) for k, c in enumerate(given["counts"])]
    strategy.aggregate_updates(1, updates)
    np.testing.assert_array_equal(strategy.global_prototypes.mask, theirs["available"])
    assert_matches(strategy.global_prototypes.vectors, theirs["global_logits"], "the strategy's global logits",
                   **tolerance)
    by_count, _ = aggregate_prototypes(uploads, given["counts"], "count")
    assert np.abs(by_count - theirs["global_logits"]).max() > 1e3 * tolerance["atol"]


def test_feddistill_client_round_equals_clientFD_train():
    """The loss per batch, CE + lambda * distillation_loss with HtFLlib's raw-logit target (a class
    without a global logit: the sample's own, detached), the model after the steps, and the uploaded
    per-class mean logits over every batch's training-mode outputs (our during-train FeatureSums)."""
    fixture = load_fixture("htfllib-feddistill-client")
    given, theirs = fixture.inputs, fixture.outputs
    global_logits, available = torch.from_numpy(given["global_logits"]), torch.from_numpy(given["available"])
    assert not available.all() and (~available[torch.from_numpy(given["y"])]).any()  # some samples' class has none
    lamda = float(given["lamda"])

    def round_(softmax_target):
        net = split_net(given)
        optimizer = torch.optim.SGD(net.parameters(), lr=float(given["local_learning_rate"]))
        seen = FeatureSums(NUM_CLASSES, NUM_CLASSES, torch.device("cpu"))
        ce, distilled, losses = [], [], []
        for x, y in _batches(given):
            logits = net(x)
            seen.add(logits, y)
            cross_entropy = F.cross_entropy(logits, y)
            distillation = distillation_loss(logits, y, global_logits, available, softmax_target)
            loss = cross_entropy + lamda * distillation
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ce.append(cross_entropy.item())
            distilled.append(distillation.item())
            losses.append(loss.item())
        return net, seen, np.array(ce), np.array(distilled), np.array(losses)

    net, seen, ce, distilled, losses = round_(False)  # target = "logits"
    assert_matches(ce, theirs["ce"], "the cross-entropy per batch")
    assert_matches(distilled, theirs["distillation"], "the distillation term per batch")
    assert_matches(losses, theirs["loss"], "the loss per batch")
    _assert_trained_net(net, given, theirs)
    np.testing.assert_array_equal(seen.counts.numpy() > 0, theirs["held"])
    scale = float(np.abs(theirs["logits"]).max())
    assert_matches(seen.means(), theirs["logits"], "the uploaded mean logits", **float32_roundings(1, scale))
    *_, softmax_losses = round_(True)
    assert _far(softmax_losses, theirs["loss"], 0.0) > 1e6  # the softmax target is another loss


def test_feddistill_client_fit_equals_clientFD_train(tmp_path):
    """FedDistillClient.fit (protofl's client: its receive, batch_loss and during-train logit
    statistics) with their lambda and the raw-logit target, the global logits sent as our server
    sends them (float32 on the wire, class 1 masked off; the fixture's are the float32 rounding our
    server sends, so the client receives exactly theirs): the weights after the steps and the
    training loss (the mean of their per-batch CE + lambda CE_soft) at FLOAT64; the uploaded
    per-class mean logits over every batch's training-mode outputs one float32 rounding from
    theirs, and the class counts."""
    fixture = load_fixture("htfllib-feddistill-client")
    given, theirs = fixture.inputs, fixture.outputs
    sent = ClassVectors(given["global_logits"].astype(np.float32), given["available"])
    np.testing.assert_array_equal(sent.vectors, given["global_logits"])  # float32 values: exact on the wire
    options = {"lambda": float(given["lamda"]), "target": "logits"}
    client, arrays, metrics = _client_fit("feddistill", given, tmp_path, options, [],
                                          sent.to_config(GLOBAL_PROTOTYPES))
    assert arrays == []  # nothing of the model is shared
    received, available = client.global_logits
    np.testing.assert_array_equal(received.numpy()[given["available"]], given["global_logits"][given["available"]])
    np.testing.assert_array_equal(available.numpy(), given["available"])
    _assert_trained_client(client, given, theirs)
    assert_matches(metrics[TRAIN_LOSS], theirs["loss"].mean(), "the training loss (their per-batch total, averaged)")
    counts, means = _uploaded(metrics, CLASS_COUNTS), _uploaded(metrics, CLASS_MEANS)
    np.testing.assert_array_equal(counts, np.bincount(given["y"], minlength=NUM_CLASSES))
    np.testing.assert_array_equal(counts > 0, theirs["held"])
    scale = float(np.abs(theirs["logits"]).max())
    assert_matches(means, theirs["logits"], "the uploaded mean logits", **float32_roundings(1, scale))


# --- FedGen -------------------------------------------------------------------------------------

def _generator(given, prefix, feature_dim) -> Generator:
    """Ours holding their generator's values (fc1 -> hidden, fc -> out), in training mode."""
    generator = Generator(int(given["noise_dim"]), NUM_CLASSES, int(given["hidden_dim"]), feature_dim)
    generator.load_state_dict({ours: torch.from_numpy(np.array(given[f"{prefix}.{ours}"]))
                               for ours in GENERATOR_NAMES.values()})
    return generator.train()


def _assert_generator(generator, given, theirs, what):
    """The generator's entries after the Adam steps. The bias of the Linear before the BatchNorm
    has a gradient of exactly 0 (the BatchNorm subtracts the batch mean), computed as rounding noise
    |g| <= 1e-15; Adam's step lr m / (sqrt(v) + 1e-8) turns it into moves of up to lr x 1e-7 each:
    on both sides that bias stays within ``noise`` = steps x lr x 1e-7 of its start, and so do they
    of each other. The BatchNorm's running mean, a convex combination of the batch means of
    W z + b, inherits that difference of b: its tolerance is the trained one's plus ``noise``."""
    steps, lr = len(given["labels"]), float(given["generator_learning_rate"])
    noise = steps * lr * 1e-7
    for name in GENERATOR_NAMES.values():
        ours, expected = generator.state_dict()[name].numpy(), theirs[f"trained.{name}"]
        initial = given[f"initial.{name}"]
        if name.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(ours, expected)
        elif name == "hidden.0.bias":
            for moved in (ours, expected):
                assert np.abs(moved - initial).max() <= noise, f"{what} {name} moved"
            assert_matches(ours, expected, f"{what} {name}", rtol=0.0, atol=noise)
        else:
            scale = max(float(np.abs(expected).max()), float(np.abs(expected - initial).max()))
            extra = noise if name == "hidden.1.running_mean" else 0.0
            assert_matches(ours, expected, f"{what} {name}", rtol=FLOAT64["rtol"],
                           atol=FLOAT64["rtol"] * scale + extra)


def _server_heads(given):
    sizes = given["sizes"]
    heads = [{k: torch.from_numpy(given[f"client{i}.{k}"]) for k in ("weight", "bias")} for i in range(len(sizes))]
    return heads, torch.from_numpy(sizes.astype(np.float64))


def _their_draws(monkeypatch, given, batch_size, noise_dim, noise_dtype):
    """torch.multinomial (the labels) and torch.rand (the uniform noise), the primitives our
    ``draw`` calls, replaced by spies that check what it asks of them (the federation's class
    counts, ``batch_size`` labels with replacement, then ``batch_size`` x ``noise_dim`` noise of
    ``noise_dtype`` from the labels' stream) and return their recorded draws, step by step.
    Returns the check, after the run, that every recorded draw was taken, from one stream."""
    distribution = given["class_counts"].sum(axis=0)  # their qualified_labels' distribution
    assert ((given["noise"] >= 0) & (given["noise"] < 1)).all()  # theirs: torch.rand, U[0, 1)
    labels, noise = iter(given["labels"]), iter(given["noise"])
    streams, drawn = [], {"labels": 0, "noise": 0}

    def their_labels(input, num_samples, replacement=False, *, generator=None, out=None):
        assert drawn["labels"] == drawn["noise"], "the last step's noise was not drawn with torch.rand"
        assert input.dtype == torch.float64 and out is None
        np.testing.assert_array_equal(input.numpy(), distribution)
        assert (num_samples, replacement) == (batch_size, True)
        assert isinstance(generator, torch.Generator)
        streams.append(generator)
        drawn["labels"] += 1
        return torch.from_numpy(next(labels)).to(torch.int64)

    def their_noise(*size, generator=None, dtype=None, device=None, **rest):
        assert drawn["noise"] == drawn["labels"] - 1, "noise drawn before the step's labels"
        assert not rest
        assert tuple(size) == (batch_size, noise_dim)
        assert dtype == noise_dtype
        assert generator is streams[-1]  # the labels' stream
        drawn["noise"] += 1
        return torch.from_numpy(next(noise)).to(dtype)

    monkeypatch.setattr(torch, "multinomial", their_labels)
    monkeypatch.setattr(torch, "rand", their_noise)

    def all_taken():
        assert next(labels, None) is None and next(noise, None) is None  # every step drew both
        assert streams and all(s is streams[0] for s in streams)  # one stream for all the steps

    return all_taken


def test_fedgen_train_generator_equals_train_generator():
    """Eq. 4: Adam steps (a fresh Adam at generator-lr) of G in training mode on CE of the clients'
    heads' logits summed with training-size weights, on their draws (labels, noise) step by step."""
    fixture = load_fixture("htfllib-fedgen-server")
    given, theirs = fixture.inputs, fixture.outputs
    heads, sizes = _server_heads(given)
    feature_dim = given["client0.weight"].shape[1]

    def trained(train_mode=True):
        generator = _generator(given, "initial", feature_dim).train(train_mode)
        optimizer = torch.optim.Adam(generator.parameters(), lr=float(given["generator_learning_rate"]))
        losses = []
        for labels, noise in zip(given["labels"], given["noise"]):
            labels = torch.from_numpy(labels)
            loss = ensemble_loss(nn.Linear(feature_dim, NUM_CLASSES), heads, sizes / sizes.sum(),
                                 generator(labels, torch.from_numpy(noise)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return generator, np.array(losses)

    generator, losses = trained()
    assert_matches(losses, theirs["loss"], "the generator's loss per step")
    _assert_generator(generator, given, theirs, "the trained generator's")
    _, eval_losses = trained(train_mode=False)
    assert _far(eval_losses, theirs["loss"], 0.0) > 1e6  # BatchNorm on its running statistics is another G


def test_fedgen_strategy_step_equals_train_generator_and_aggregate_parameters(tmp_path, monkeypatch):
    """FedGenStrategy.aggregate_updates: the heads averaged by training size (their
    aggregate_parameters) and its generator trained (server-epochs, generator-lr, the run's batch
    size) on labels from the clients' uploaded class counts. Our ``draw`` runs; only the primitives
    it draws with (torch.multinomial for the labels, torch.rand for the uniform noise) are replaced
    by spies that check their arguments and return their draws, in order."""
    fixture = load_fixture("htfllib-fedgen-server")
    given, theirs = fixture.inputs, fixture.outputs
    strategy, names = _strategy("fedgen", tmp_path, batch_size=int(given["batch_size"]), **{
        "noise-dim": int(given["noise_dim"]), "hidden-dim": int(given["hidden_dim"]),
        "generator-lr": float(given["generator_learning_rate"]), "server-epochs": int(given["server_epochs"])})
    assert names == ["head.weight", "head.bias"]
    feature_dim = given["client0.weight"].shape[1]
    strategy.generator.load_state_dict(_generator(given, "initial", feature_dim).state_dict())
    strategy.admission.sent_parameters = strategy.shared_weights()
    all_taken = _their_draws(monkeypatch, given, int(given["batch_size"]), int(given["noise_dim"]),
                             next(strategy.generator.parameters()).dtype)
    updates = [ClientUpdate(i, int(n), [given[f"client{i}.weight"], given[f"client{i}.bias"]], None, {},
                            {LABEL_COUNTS: given["class_counts"][i].astype(np.int64)})
               for i, n in enumerate(given["sizes"])]
    weight, bias = strategy.aggregate_updates(1, updates)
    all_taken()
    for name, ours in (("weight", weight), ("bias", bias)):
        scale = max(np.abs(given[f"client{i}.{name}"]).max() for i in range(len(updates)))
        _scaled(ours, theirs[f"head.{name}"], f"the aggregate head.{name}", scale)
    _assert_generator(strategy.generator, given, theirs, "the server's generator's")


def test_fedgen_draw_is_multinomial_labels_then_uniform_noise():
    """``draw`` on a seeded stream: the labels torch.multinomial draws with replacement from the
    distribution, then the noise torch.rand draws from the same stream (uniform on [0, 1)), the
    features G(labels, noise), each exactly."""
    distribution = torch.tensor([3.0, 0.0, 5.0, 1.0], dtype=torch.float64)
    ours = torch.Generator().manual_seed(7)
    labels, features = fedgen.draw(lambda y, z: z, distribution, 64, 4, ours)
    again = torch.Generator().manual_seed(7)
    expected_labels = torch.multinomial(distribution, 64, replacement=True, generator=again)
    expected_noise = torch.rand(64, 4, generator=again, dtype=torch.float64)
    assert torch.equal(labels, expected_labels) and torch.equal(features, expected_noise)
    assert features.dtype == torch.float64 and ((features >= 0) & (features < 1)).all()
    assert not (labels == 1).any()  # a class of count 0 is never drawn


def test_fedgen_client_round_equals_clientGen_train():
    """The client's loss per batch, CE(f(x), y) + CE(head(G(y~)), y~) (FedGenClient.batch_loss's
    term: G in training mode, not trained), on their draws, and the model after the steps."""
    fixture = load_fixture("htfllib-fedgen-client")
    given, theirs = fixture.inputs, fixture.outputs
    batches = _batches(given)
    assert len(given["labels"]) == len(batches)

    def round_(train_mode=True):
        net = split_net(given)
        generator = _generator(given, "generator", net.head.in_features).train(train_mode).requires_grad_(False)
        optimizer = torch.optim.SGD(net.parameters(), lr=float(given["local_learning_rate"]))
        ce, generated, losses = [], [], []
        for (x, y), labels, noise in zip(batches, given["labels"], given["noise"]):
            labels = torch.from_numpy(labels)
            cross_entropy = F.cross_entropy(net(x), y)
            with torch.no_grad():
                features = generator(labels, torch.from_numpy(noise))
            term = F.cross_entropy(net.head(features), labels)
            loss = cross_entropy + term
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ce.append(cross_entropy.item())
            generated.append(term.item())
            losses.append(loss.item())
        return net, np.array(ce), np.array(generated), np.array(losses)

    net, ce, generated, losses = round_()
    assert_matches(ce, theirs["ce"], "the cross-entropy per batch")
    assert_matches(generated, theirs["generated"], "the generated features' cross-entropy per batch")
    assert_matches(losses, theirs["loss"], "the loss per batch")
    _assert_trained_net(net, given, theirs)
    *_, eval_generated, _ = round_(train_mode=False)
    assert _far(eval_generated, theirs["generated"], 0.0) > 1e6


def test_fedgen_client_fit_equals_clientGen_train(tmp_path, monkeypatch):
    """FedGenClient.fit (protofl's client: its receive, which builds G from the broadcast in
    training mode, and batch_loss, which calls our ``draw``) with their generator and class counts
    broadcast as our server sends them (G's entries, float64, and the int64 federation counts) and
    their head on the parameters channel: the weights after the steps and the training loss (the
    mean of their per-batch CE + generated-feature CE) at FLOAT64, the head uploaded and the class
    counts. Only torch.multinomial and torch.rand are replaced (by :func:`_their_draws`), so
    ``draw``'s own choices run."""
    fixture = load_fixture("htfllib-fedgen-client")
    given, theirs = fixture.inputs, fixture.outputs
    generator = _generator(given, "generator", SMALL_DIM)
    entries = [t.numpy() for t in generator_entries(generator).values()]
    distribution = given["class_counts"].sum(axis=0).astype(np.int64)
    head = [given["model.head.weight"], given["model.head.bias"]]  # their client trains under its own head
    options = {"noise-dim": int(given["noise_dim"]), "hidden-dim": int(given["hidden_dim"])}
    all_taken = _their_draws(monkeypatch, given, int(given["batch_size"]), int(given["noise_dim"]), torch.float64)
    client, arrays, metrics = _client_fit("fedgen", given, tmp_path, options, head,
                                          indexed(GENERATOR, entries) | {LABEL_DISTRIBUTION: distribution})
    all_taken()
    assert len(given["labels"]) == len(_batches(given))  # one draw per step
    _assert_trained_client(client, given, theirs)
    assert len(arrays) == 2  # the shared entries: the trained head
    for name, array in zip(("head.weight", "head.bias"), arrays):
        _trained(array, theirs[f"trained.{name}"], given[f"model.{name}"], f"the uploaded {name}")
    assert_matches(metrics[TRAIN_LOSS], theirs["loss"].mean(), "the training loss (their per-batch total, averaged)")
    np.testing.assert_array_equal(_uploaded(metrics, LABEL_COUNTS), np.bincount(given["y"], minlength=NUM_CLASSES))
