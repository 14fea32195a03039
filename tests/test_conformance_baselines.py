"""FedProx, MOON, SCAFFOLD and FedNTD against numbers PFLlib's code (TsingZ0/PFLlib) computed on
the same inputs: two rounds of a federation of four clients, our clients and server in place of
theirs.

The fixtures (tests/conformance/fixtures/{fedprox,moon,scaffold,fedntd}-pfllib-rounds.npz) and the
calls that made them are described in tests/conformance/pfllib_baselines.py; their code is not run
here. Round 1 trains clients 0, 1, 2 from the initial model (our ``cnn``, seed 0), round 2 clients
1, 2, 3 from our server's round-1 aggregate (as a real run: what our clients trained to, not the
fixture's numbers); each client is made afresh for each round (its model a copy of the initial
one, built once) with its partition's own store, as a deployment's node, so what it keeps (MOON's
previous model, SCAFFOLD's c_i) comes from its round-1 fit, and client 3 has none in round 2. Our
run settings are PFLlib's: plain SGD (no momentum, no weight decay), the trailing partial batch
dropped, one local epoch, lr 0.05, batch 4; the method's options are the values their code ran
with (``input.their.*``, our names in ``METHODS``), FedNTD's average unweighted (PFLlib's
``serverntd``). Each client's config carries the seed whose ``torch.randperm`` gave the order
their loader took the client's images in, so both train on the same batches.

Tolerances. Both sides compute in float64 (tests/conftest.py, make_fixtures.py), and nothing here
is rounded to float32 on purpose: our parameters, SCAFFOLD's control variates (the model's dtype)
and our losses stay float64 on the wire. So one formula agrees to ``FLOAT64`` (rtol 1e-9,
derived in tests/conformance/common.py: a few SGD steps that amplify at most 10-fold, sums that
cancel at most 100-fold). Model entries are compared through their fingerprints (a difference d
moves each projection by about |d|), with ``atol = 1e-9 x scale``, ``scale`` the sum of the norms
of the terms the value is computed from (n u sum|terms| is the rounding bound; the norms are the
fixture's):

- trained weights y: ||y|| (the SGD steps, as in the other conformance tests);
- a FedAvg aggregate (a convex combination of the y_i): max ||y_i||;
- SCAFFOLD's x + eta_g mean(y_i - x): ||x|| + max ||y_i|| (eta_g <= 1);
- c_i+ = c_i - c + (x - y) / (K eta): ||c_i|| + ||c|| + (||x|| + ||y||) / (K eta) (the division
  scales the weights' own error by the same 1 / (K eta) as the terms);
- Delta c = c_i+ - c_i: that of c_i+ plus ||c_i||;
- the server's c + sum(Delta c_i) / N: ||c|| + sum of the Delta c_i's scales / N.

The losses: the mean over the steps, to ``FLOAT64``; a method's own term (MOON's l_con, FedNTD's
L_NTD), which their code adds to the cross-entropy in place, is their recorded total minus their
cross-entropy, to 1e-9 of the two terms subtracted.
"""

import copy
import io

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64, assert_matches, fingerprint, load_fixture, pixels_to_input
from conformance.pfllib_baselines import METHODS, NUM_CLASSES, NUM_CLIENTS, ROUNDS, batch_order, names
from fakes import OK, FakeProxy
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.partitions import PartitionClaim
from protofl.federation.wire import CONTRASTIVE_LOSS, PROXIMAL_LOSS, TRAIN_LOSS, encode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.fedntd import NTD_LOSS
from protofl.strategies.scaffold import CONTROL_DELTA, PENDING_CONTROL
from protofl.task.data import ClientData

pytestmark = pytest.mark.conformance


def _options(method, given) -> dict:
    """Our options of ``method``: their arguments' values under our names, and the others ``METHODS`` sets."""
    _, _, theirs, others = METHODS[method]
    return {ours: float(given[f"their.{name}"]) for name, (ours, _) in theirs.items()} | others


def _settings(method, given, tmp_path, options=None) -> ExperimentSettings:
    """Our run settings of the fixture's (``options``: ours, default from ``METHODS``)."""
    return ExperimentSettings(
        method=method, model="cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]),
        batch_size=int(given["batch_size"]), partial_batch="drop", lr=float(given["lr"]), momentum=0.0,
        weight_decay=0.0, amp="off", channels_last=False, output_dir=str(tmp_path), run_name="conformance",
        options=_options(method, given) if options is None else options,
    )


def _data(given, p) -> ClientData:
    x, y = pixels_to_input(given[f"client{p}.pixels"]), torch.from_numpy(given[f"client{p}.labels"])
    return ClientData(p, NUM_CLASSES, x, y, x, y)  # (the test split is not used by fit)


def _strategy(settings, data):
    """Our server after discovery: nodes 100..103 hold partitions 0..3 of sizes it knows, so it
    knows the federation's N (SCAFFOLD's 1 / N)."""
    strategy = get_method(settings.method)[0](settings, build_method_model(settings, data[0]), NUM_CLASSES)
    registry = strategy.discovery.registry
    for p, d in data.items():
        registry.claims[str(100 + p)] = PartitionClaim(p, NUM_CLIENTS, d.num_train, d.num_test)
    registry.freeze()
    strategy.discovery.nodes = {p: FakeProxy(node) for p, node in registry.holders(registry.claims).items()}
    assert strategy.num_clients == NUM_CLIENTS
    return strategy


def _assert_fingerprint(array, expected, what, scale=None):
    """``array`` (ours) against the fingerprint of theirs, to 1e-9 of ``scale`` (default: its norm)."""
    scale = expected[1] if scale is None else scale
    assert_matches(fingerprint(array), expected, what, rtol=0.0, atol=FLOAT64["rtol"] * scale)


def _norm(theirs, prefix, name) -> float:
    """The norm of a stored array (its fingerprint's second entry); 0 for one not stored (a zero
    control variate)."""
    key = f"{prefix}.{name}"
    return float(theirs[key][1]) if key in theirs else 0.0


def _two_rounds(method, tmp_path, check_client=None, check_server=None, options=None, expected_loss=None,
                fixture=None):
    """Our clients and server through the fixture's two rounds, each client's trained weights and
    training loss and each round's aggregate compared with theirs; ``check_client(r, p, client,
    metrics, sent_prefix)`` and ``check_server(r, strategy, sent_prefix)`` (``sent_prefix``: the
    fixture's name of the model the round started from) compare the method's own. ``options``: our
    options (default: from ``METHODS``); ``expected_loss(prefix)``: their mean training loss of a
    client's round (default: of their recorded ``.loss``); ``fixture``: the method whose fixture
    holds the expected numbers (default ``method``). Returns our last round's aggregate."""
    fixture = load_fixture(f"{fixture or method}-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(method, given, tmp_path, options)
    data = {p: _data(given, p) for p in range(NUM_CLIENTS)}
    strategy = _strategy(settings, data)
    our_names = names(strategy.model)
    _, client_class = get_method(method)
    stores = {p: RecordDict() for p in range(NUM_CLIENTS)}  # each node's, across rounds
    initial = build_method_model(settings, data[0])  # every client's (one architecture, one seed)
    sent = strategy.shared_weights()  # round 1: the initial model, ours and theirs
    for name, array in zip(our_names, sent):
        _assert_fingerprint(array, theirs[f"initial.{name}"], f"initial {name}")
    previous = "initial"
    for r, clients in ROUNDS.items():
        strategy.sampled = list(clients)
        strategy.admission.asked = {str(100 + p): p for p in clients}
        strategy.admission.sent_parameters = sent
        broadcast = {k: encode_array(v) for k, v in strategy.broadcast(r).items()}  # SCAFFOLD's c
        results = []
        for p in clients:
            prefix, seed = f"round{r}.client{p}", int(given[f"round{r}.client{p}.seed"])
            # the order their loader took the images in is the one our training loop draws from this seed
            np.testing.assert_array_equal(batch_order(data[p].num_train, seed), given[f"{prefix}.order"])
            client = client_class(settings, data[p], copy.deepcopy(initial), NUM_CLIENTS, stores[p])
            own = {k: encode_array(v) for k, v in strategy.broadcast_to(r, p).items()}  # SCAFFOLD's applied round
            arrays, num_examples, metrics = client.fit(sent, {"server-round": r, "seed": seed} | broadcast | own)
            for name, array in zip(our_names, arrays):
                _assert_fingerprint(array, theirs[f"{prefix}.trained.{name}"], f"{prefix} trained {name}")
            if expected_loss is not None:
                expected = expected_loss(prefix)
            elif method == "fedprox":  # their loss is CE alone, mu ||w - x||^2 / 2 is in their step
                expected = (theirs[f"{prefix}.loss"] + float(given["their.mu"]) * theirs[f"{prefix}.proximal"]).mean()
            else:
                expected = theirs[f"{prefix}.loss"].mean()
            assert_matches(metrics[TRAIN_LOSS], expected, f"{prefix} training loss")
            if check_client is not None:
                check_client(r, p, client, metrics, previous)
            results.append((FakeProxy(str(100 + p)), FitRes(OK, ndarrays_to_parameters(arrays), num_examples, metrics)))
        parameters, summary = strategy.aggregate_fit(r, results, [])
        assert summary["accepted"] == len(clients)
        aggregate = parameters_to_ndarrays(parameters)
        for name, array in zip(our_names, aggregate):
            trained = max(_norm(theirs, f"round{r}.client{p}.trained", name) for p in clients)
            scale = trained + (_norm(theirs, previous, name) if method in ("scaffold", "pfedme") else 0.0)
            _assert_fingerprint(array, theirs[f"round{r}.aggregate.{name}"], f"round {r} aggregate {name}", scale)
        if check_server is not None:
            check_server(r, strategy, previous)
        sent, previous = aggregate, f"round{r}.aggregate"
    return sent


def _loss_term(theirs, prefix, factor) -> tuple[float, float]:
    """Their method's term, mean over the steps: (their total - their CE) / factor; and its tolerance."""
    total, ce = theirs[f"{prefix}.loss"], theirs[f"{prefix}.ce"]
    return (total.mean() - ce.mean()) / factor, FLOAT64["rtol"] * (np.abs(total).mean() + np.abs(ce).mean()) / factor


def test_fedprox_two_rounds_equal_pfllib(tmp_path):
    """Each step w <- w - eta (grad CE + mu (w - x)) (their PerturbedGradientDescent; ours the
    gradient of CE + mu ||w - x||^2 / 2), the sample-weighted FedAvg of their server."""
    theirs = load_fixture("fedprox-pfllib-rounds").outputs

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        assert_matches(metrics[PROXIMAL_LOSS], theirs[f"{prefix}.proximal"].mean(), f"{prefix} ||w - x||^2 / 2",
                       rtol=0.0, atol=FLOAT64["rtol"] * np.abs(theirs[f"{prefix}.proximal"]).max())

    _two_rounds("fedprox", tmp_path, check_client)


def test_moon_two_rounds_equal_pfllib(tmp_path):
    """CE + mu l_con with z_prev of the client's own last trained model (round 2: clients 1 and 2
    their round-1 model, client 3 the initial one, which their clients keep as old_model), z_glob
    of the global model; the sample-weighted FedAvg of their server."""
    fixture = load_fixture("moon-pfllib-rounds")
    theirs, mu = fixture.outputs, float(fixture.inputs["their.mu"])

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        expected, atol = _loss_term(theirs, prefix, mu)
        assert_matches(metrics[CONTRASTIVE_LOSS], expected, f"{prefix} l_con", rtol=0.0, atol=atol)
        if r == 1:  # z_prev and z_glob of the same model: l_con = log 2
            assert_matches(metrics[CONTRASTIVE_LOSS], np.log(2.0), f"{prefix} l_con of round 1")

    _two_rounds("moon", tmp_path, check_client)


def test_scaffold_two_rounds_equal_pfllib(tmp_path):
    """Steps y <- y - eta (grad CE + c - c_i), c_i+ = c_i - c + (x - y) / (K eta) and Delta c
    (option II), the server's x + eta_g mean(y_i - x) and c + sum(Delta c_i) / N with N = 4 clients
    of which 3 train each round."""
    fixture = load_fixture("scaffold-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    eta = float(given["lr"])
    delta_scales: dict[tuple[int, str], float] = {}  # (round, name) -> sum of the Delta c_i's scales

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        steps = int(given["epochs"]) * (client.data.num_train // int(given["batch_size"]))  # K
        before = next((f"round{q}.client{p}.control" for q in range(r - 1, 0, -1) if p in ROUNDS[q]), "")
        control = f"round{r - 1}.server_control"  # c this round (none in round 1: zero)
        for i, name in enumerate(names(client.model)):
            c_i, c = _norm(theirs, before, name), _norm(theirs, control, name)
            x, y = _norm(theirs, sent_prefix, name), _norm(theirs, f"{prefix}.trained", name)
            scale = c_i + c + (x + y) / (steps * eta)
            _assert_fingerprint(client.local_state[PENDING_CONTROL + name], theirs[f"{prefix}.control.{name}"],
                                f"{prefix} c_i+ {name}", scale)
            delta = np.load(io.BytesIO(metrics[f"{CONTROL_DELTA}/{i}"]))  # the upload
            delta_scale = scale + c_i
            _assert_fingerprint(delta, theirs[f"{prefix}.control_delta.{name}"], f"{prefix} Delta c {name}",
                                delta_scale)
            delta_scales[r, name] = delta_scales.get((r, name), 0.0) + delta_scale

    def check_server(r, strategy, sent_prefix):
        for name, control in zip(names(strategy.model), strategy.control):
            scale = _norm(theirs, f"round{r - 1}.server_control", name) + delta_scales[r, name] / NUM_CLIENTS
            _assert_fingerprint(control, theirs[f"round{r}.server_control.{name}"], f"round {r} c {name}", scale)

    _two_rounds("scaffold", tmp_path, check_client, check_server)


def test_fedntd_two_rounds_equal_pfllib(tmp_path):
    """CE + beta tau^2 KL(global || local) of the not-true softmaxes (the global model in eval mode),
    and their server's uniform average (ours with ``weighted = false``)."""
    fixture = load_fixture("fedntd-pfllib-rounds")
    theirs, beta = fixture.outputs, float(fixture.inputs["their.beta"])

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        expected, atol = _loss_term(theirs, prefix, beta)
        assert_matches(metrics[NTD_LOSS], expected, f"{prefix} L_NTD", rtol=0.0, atol=atol)

    _two_rounds("fedntd", tmp_path, check_client)
