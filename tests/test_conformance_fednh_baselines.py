"""FedPer, FedRep, FedBABU, FedRoD and Ditto against numbers the code of FedNH's authors
(Yutong-Dai/FedNH) computed on the same inputs: one round of two clients and one aggregation, our
clients (``fit``, FedBABU's ``evaluate``) and server (``aggregate_fit``) in place of theirs.

The fixtures (tests/conformance/fixtures/fednh-{fedper,fedrep,fedbabu,fedrod-hyper,fedrod-linear,
ditto}-round.npz) and the calls that made them are described in tests/conformance/fednh_baselines.py;
their code is not run here. Our run settings are theirs: model ``fednh-cnn`` built with seed 2022
(their Conv2Cifar after ``torch.manual_seed(2022)``: checked), round 2 at lr 0.01 x 0.99, 1 local
epoch of one full batch, momentum 0, weight decay 0, a max-grad-norm (1000) no step reaches (their
clipping at 10 never acted: the fixture's ``largest_gradient_norm``), ``weighted = false`` (their
unweighted mean). The method's options are the values the fixture ran their code with (``METHODS``):
FedRep's ``head-epochs`` 3, FedBABU's ``finetune-epochs`` 2, FedRoD's ``personal-training =
"separate"`` with ``personal-head = "hyper"`` (the hypernetwork's initial values sent as the
round's parameters: ``hypernetwork_init``) and ``"linear"``, Ditto's ``lambda`` 0.75 and
``reference = "trained"`` (our default, ``"received"``, is compared with their step moved to the
received model, and in a further round with a step derived by hand). FedBABU's fine-tune: our
client fine-tunes in ``evaluate`` at the lr of the round it is told; their final fine-tune runs at
round ``num_rounds + 1``'s (``input.final_round``): ``evaluate`` is told that round, so that the
two compute at one lr.

Tolerances. Both sides compute in float64 and nothing here is rounded to float32 (our parameters
and losses keep the model's dtype on the wire): one formula agrees to ``FLOAT64`` (rtol 1e-9,
derived in tests/conformance/common.py: a few SGD steps that amplify at most 10-fold, sums that
cancel at most 100-fold). Model entries are compared through fingerprints (a difference d moves
each projection by about |d|) with ``atol = 1e-9 x scale``, ``scale`` the norm of the terms the
value is computed from (the rounding bound is n u sum|terms|; the norms are the fixture's):

- trained, fine-tuned and personal weights y: ||y||;
- an aggregate, the unweighted mean of the y_i (theirs x + mean(y_i - x)): max ||y_i|| + ||x||;
- an entry the server does not average (the initial head in GM): ||x||, which it equals exactly.

The personal heads (stored whole): to 1e-9 of their largest entry (an entry near zero is a
difference of terms of that size). The training loss (their per-epoch loss, one step an epoch,
against our mean over the steps): ``FLOAT64``.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conformance.common import FLOAT64, assert_matches, fingerprint, load_fixture, pixels_to_input
from conformance.fednh_baselines import (
    CLIENT_LABELS,
    FINETUNE_EPOCHS,
    HEAD_EPOCHS,
    LAMBDA,
    NUM_CLASSES,
    hypernetwork_init,
    their_names,
)
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.wire import SEED, SERVER_ROUND, TRAIN_LOSS
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.ditto import PERSONAL
from protofl.strategies.fedrod import label_distribution
from protofl.task.data import ClientData

pytestmark = pytest.mark.conformance

SEPARATE = {"personal-training": "separate"}  # FedNH's FedROD_phead_separate = True
METHODS = {  # fixture -> (our method, our options)
    "fedper": ("fedper", {}),
    "fedrep": ("fedrep", {"head-epochs": HEAD_EPOCHS}),
    "fedbabu": ("fedbabu", {"finetune-epochs": FINETUNE_EPOCHS}),
    "fedrod-hyper": ("fedrod", {"personal-head": "hyper"} | SEPARATE),
    "fedrod-linear": ("fedrod", {"personal-head": "linear"} | SEPARATE),
    "ditto": ("ditto", {"lambda": LAMBDA, "reference": "trained"}),
}


def _settings(method, given, tmp_path, options=None) -> ExperimentSettings:
    ours, method_options = METHODS[method]
    options = method_options if options is None else options
    return ExperimentSettings(
        method=ours, model="fednh-cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]),
        batch_size=int(given["batch_size"]), lr=float(given["lr"]), lr_decay=float(given["lr_decay"]),
        momentum=float(given["momentum"]), weight_decay=float(given["weight_decay"]), max_grad_norm=1000.0,
        amp="off", channels_last=False, test_fraction=0.0, output_dir=str(tmp_path), run_name="conformance",
        options=options | {"weighted": False},
    )


def _data(given, partition_id, k):
    x, y = pixels_to_input(given[f"client_{k}.pixels"]), torch.from_numpy(given[f"client_{k}.labels"])
    return ClientData(partition_id, NUM_CLASSES, x, y, x, y)  # (the test split: FedBABU's evaluate only)


def _assert_fingerprint(array, expected, what, scale=None):
    """``array`` (ours) against the fingerprint of theirs, to 1e-9 of ``scale`` (default: its norm)."""
    scale = expected[1] if scale is None else scale
    assert_matches(fingerprint(array), expected, what, rtol=0.0, atol=FLOAT64["rtol"] * scale)


def _assert_state(tensors, theirs, prefix, names):
    for name in names:
        _assert_fingerprint(tensors[name].detach().numpy(), theirs[f"{prefix}.{name}"], f"{prefix} {name}")


def _assert_whole(actual, expected, what):
    expected = np.asarray(expected)
    assert_matches(actual, expected, what, rtol=0.0, atol=FLOAT64["rtol"] * np.abs(expected).max())


def _one_round(method, tmp_path, check_client=None, options=None):
    """Our two clients' fit from the fixture's initial model, each client's trained weights and
    loss compared with theirs (``check_client(k, client, config)`` the method's own), then our
    server's aggregate. ``options``: ours (default: ``METHODS``'). Returns (aggregate, strategy,
    fixture, clients)."""
    fixture = load_fixture(f"fednh-{method}-round")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(method, given, tmp_path, options)
    data = {k: _data(given, p, k) for p, k in enumerate(CLIENT_LABELS)}
    strategy_class, client_class = get_method(settings.method)
    strategy = strategy_class(settings, build_method_model(settings, data["a"]), NUM_CLASSES)
    names = list(their_names(method).values())  # every entry their model has, by our names
    start_round(strategy, range(len(data)))
    configs = strategy.round_configs(int(given["round"]), range(len(data)))
    results, clients = [], {}
    for (p, k), config in zip(enumerate(data), configs):
        client = client_class(settings, data[k], build_method_model(settings, data[k]), len(data), RecordDict())
        initial = client.model.state_dict()
        if method == "fedrod-hyper":  # their hypercls's initial values (ours is drawn otherwise), sent
            initial |= {n: torch.from_numpy(v) for n, v in hypernetwork_init().items()}
        _assert_state(initial, theirs, "initial", names)  # the same seeded model (torch.manual_seed(2022))
        sent = [initial[name].detach().numpy() for name in client.shared_names]
        strategy.admission.sent_parameters = sent
        arrays, num_examples, metrics = client.fit(sent, config)
        _assert_state(client.model.state_dict(), theirs, f"client_{k}.trained", names)
        assert_matches(metrics[TRAIN_LOSS], theirs[f"client_{k}.loss"].mean(), f"client {k} training loss")
        if check_client is not None:
            check_client(k, client, config)
        clients[k] = client
        results.append((FakeProxy(str(100 + p)), FitRes(OK, ndarrays_to_parameters(arrays), num_examples, metrics)))
    parameters, summary = strategy.aggregate_fit(int(given["round"]), results, [])
    assert summary["accepted"] == len(data)
    aggregate = parameters_to_ndarrays(parameters)
    shared = clients["a"].shared_names
    for name, array in zip(shared, aggregate):
        scale = max(theirs[f"client_{k}.trained.{name}"][1] for k in data) + theirs[f"initial.{name}"][1]
        _assert_fingerprint(array, theirs[f"aggregate.{name}"], f"aggregate {name}", scale)
    return aggregate, strategy, fixture, clients


def _assert_gm_is_their_server_model(method, aggregate, strategy, theirs):
    """GM: the aggregated body with the initial head, their server's model (whose head their
    server never updates)."""
    entries = dict(zip(strategy.model.state_dict(), strategy.global_model_weights(aggregate)))
    for name in their_names(method).values():
        scale = max(theirs[f"client_{k}.trained.{name}"][1] for k in CLIENT_LABELS) + theirs[f"initial.{name}"][1]
        _assert_fingerprint(entries[name], theirs[f"aggregate.{name}"], f"GM {name}", scale)
    np.testing.assert_array_equal(entries["head.weight"], strategy.initial_weights[
        list(strategy.model.state_dict()).index("head.weight")])


def test_fedper_round_equals_the_codes(tmp_path):
    """The whole model trained with CE (the client's own head); the body's unweighted mean."""
    aggregate, strategy, fixture, _ = _one_round("fedper", tmp_path)
    _assert_gm_is_their_server_model("fedper", aggregate, strategy, fixture.outputs)


def test_fedrep_round_equals_the_codes(tmp_path):
    """The head ``head-epochs`` epochs with the body frozen, then the body ``local-epochs`` epochs
    with the head frozen; the body's unweighted mean."""
    aggregate, strategy, fixture, _ = _one_round("fedrep", tmp_path)
    _assert_gm_is_their_server_model("fedrep", aggregate, strategy, fixture.outputs)


def test_fedbabu_round_and_finetune_equal_the_codes(tmp_path):
    """The body trained through the frozen initial head; the body's unweighted mean; before scoring,
    client A's whole model fine-tuned ``finetune-epochs`` epochs from the aggregated body (their final
    fine-tune, ``training(num_rounds + 1, FedBABU_finetune_epoch)`` with every layer unfrozen)."""
    aggregate, strategy, fixture, clients = _one_round("fedbabu", tmp_path)
    theirs = fixture.outputs
    _assert_gm_is_their_server_model("fedbabu", aggregate, strategy, theirs)
    final_round = int(fixture.inputs["final_round"])
    client = clients["a"]  # (the fixture fine-tunes client A)
    client.evaluate(aggregate, {SERVER_ROUND: final_round, SEED: 0})
    _assert_state(client.model.state_dict(), theirs, "client_a.finetuned", their_names("fedbabu").values())
    assert not client.model.head.weight.requires_grad  # the head frozen again for training


def _fedrod(method, tmp_path):
    fixture = load_fixture(f"fednh-{method}-round")
    given, theirs = fixture.inputs, fixture.outputs

    def check_client(k, client, config):
        if method == "fedrod-hyper":
            # p_i: their count_by_class_full / sum, 1e-12 for an absent class
            assert_matches(label_distribution(client.data.class_counts()), given[f"client_{k}.label_distribution"],
                           "p_i")
            with torch.no_grad():
                generated = client.model.hypernetwork(client.distribution)
            _assert_whole(generated, theirs[f"client_{k}.personal_head"], f"client {k} hypernetwork(p_i)")
        else:
            _assert_whole(client.model.personal_head.weight.detach(), theirs[f"client_{k}.personal_head"],
                          f"client {k} personal head")

    _one_round(method, tmp_path, check_client)


def test_fedrod_hyper_round_equals_the_codes(tmp_path):
    """The body and g with the balanced softmax (every epoch), then the hypernetwork with CE of
    g(z) + z hyper(p_i) (every epoch); the unweighted mean of the body, g and the hypernetwork."""
    _fedrod("fedrod-hyper", tmp_path)


def test_fedrod_linear_round_equals_the_codes(tmp_path):
    """As with the hypernetwork, p a linear head (g's initial values) kept by the client."""
    _fedrod("fedrod-linear", tmp_path)


def test_ditto_round_equals_the_codes(tmp_path):
    """The global model as FedAvg's, then the personal model (the initial one) with CE + lambda/2
    ||v - w||^2, w the client's trained global model; the unweighted mean of the global models."""
    names = list(their_names("ditto").values())
    theirs = load_fixture("fednh-ditto-round").outputs

    def check_client(k, client, config):
        personal = {n: torch.from_numpy(client.local_state[PERSONAL + n]) for n in names}
        _assert_state(personal, theirs, f"client_{k}.personal", names)

    _one_round("ditto", tmp_path, check_client)


def test_ditto_default_received_reference_equals_their_step_moved_to_the_received_model(tmp_path):
    """Ditto's default ``reference = "received"`` (the paper's Algorithm 1, PFLlib's): the personal
    step v1 = v0 - eta (grad CE(v0) + lambda (v0 - w)) with w = w^t, the global model received,
    where their code's w is w', the client's global model after its training. Every training here
    is one step from v0 = w^t (one full batch, one epoch, the initial personal model = the model
    sent), so v1(w^t) = v1(w') - eta lambda (w' - w^t) exactly in real arithmetic: ours plus
    eta lambda (w' - w^t) (w' our trained global model, itself compared with theirs; w^t the
    initial model, likewise) is compared with their personal model.

    Tolerance: 1e-9 x the norms of the terms (``FLOAT64``, as the module's): ||v1|| (theirs) +
    eta lambda (||w'|| + ||w^t||). The correction itself is checked to be over 1e3 tolerances, so
    that the personal model stepped towards w' instead fails.

    There lambda (v0 - w^t) is 0. So client A then trains round 3 from the aggregate w3, its kept v1
    apart from it: its personal model against v1 - eta3 (grad CE(v1) + lambda (v1 - w3)) derived by
    hand (grad CE by torch.autograd on a copy holding v1, its one full batch), to 1e-9 x (the
    largest |v2| + eta3 lambda (the largest |v1| + the largest |w3|)) an entry; the lambda term
    checked to be over 1e3 of those."""
    names = list(their_names("ditto").values())
    fixture = load_fixture("fednh-ditto-round")
    given, theirs = fixture.inputs, fixture.outputs
    round_ = int(given["round"])
    options = {k: v for k, v in METHODS["ditto"][1].items() if k != "reference"}  # the default reference

    def check_client(k, client, config):
        eta = client.settings.round_lr(round_)
        received = build_method_model(client.settings, client.data).state_dict()  # w^t: the model sent
        trained = client.model.state_dict()  # w'
        for n in names:
            correction = eta * LAMBDA * (trained[n].numpy() - received[n].numpy())
            scale = theirs[f"client_{k}.personal.{n}"][1] + eta * LAMBDA * (
                theirs[f"client_{k}.trained.{n}"][1] + theirs[f"initial.{n}"][1])
            _assert_fingerprint(client.local_state[PERSONAL + n] + correction, theirs[f"client_{k}.personal.{n}"],
                                f"client_{k}.personal {n}, moved to the received reference", scale)
            moved = np.abs(fingerprint(correction)[2:]).max()  # the projections, linear in the array
            assert moved > 1e3 * FLOAT64["rtol"] * scale, f"client {k} {n}: the references are not told apart"

    aggregate, _, _, clients = _one_round("ditto", tmp_path, check_client, options=options)
    client = clients["a"]
    v1 = {n: np.array(client.local_state[PERSONAL + n]) for n in names}
    w3 = dict(zip(client.shared_names, aggregate))
    reference = build_method_model(client.settings, client.data)
    reference.load_state_dict({n: torch.from_numpy(a) for n, a in v1.items()})
    ce = F.cross_entropy(reference(client.data.train_x)[1], client.data.train_y)
    parameters = dict(reference.named_parameters())
    gradient = dict(zip(parameters, torch.autograd.grad(ce, list(parameters.values()))))
    eta = client.settings.round_lr(round_ + 1)
    client.fit(aggregate, {SERVER_ROUND: round_ + 1, SEED: 0})
    for n in names:
        term = eta * LAMBDA * (v1[n] - w3[n])
        expected = v1[n] - eta * gradient[n].numpy() - term
        scale = np.abs(expected).max() + eta * LAMBDA * (np.abs(v1[n]).max() + np.abs(w3[n]).max())
        assert_matches(client.local_state[PERSONAL + n], expected, f"client_a's round-3 personal {n}",
                       rtol=FLOAT64["rtol"], atol=FLOAT64["rtol"] * scale)
        assert np.abs(term).max() > 1e3 * FLOAT64["rtol"] * scale, f"{n}: lambda (v1 - w3) is not told apart"
