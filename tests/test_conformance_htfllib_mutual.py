"""FML and FedKD against numbers HtFLlib's code (TsingZ0/HtFLlib) computed on the same inputs: one
round of three clients and the server's step, our clients (``fit``) and server (``aggregate_fit``) in
place of theirs; FedKD's SVD compression (``low_rank``) and its energy schedule on their own.

The fixtures (tests/conformance/fixtures/htfllib-{fml,fedkd}-*.npz) and the calls that made them
are described in tests/conformance/htfllib_mutual.py; their code is not run here. Our run settings
are theirs: the shared model our ``cnn`` (seed 0; FedKD's sent with the fixture's near rank-1 head
weight), each client's own model the fixture's seeded MLP (passed to our client as its model), plain
SGD (no momentum, no weight decay) at lr 0.05, one local epoch of batches of 4, the trailing partial
batch dropped, ``max-grad-norm = "auto"`` (the methods' 10, each module clipped on its own), FML's
alpha = beta = 0.5, FedKD's energy 0.95 -> 0.98, the methods' unweighted mean. Each client's config
carries the seed whose ``torch.randperm`` gave the order their loader took its images in.

Tolerances. Both sides compute in float64 and nothing here is rounded to float32 (our parameters and
losses keep the model's dtype on the wire): one formula agrees to ``FLOAT64`` (rtol 1e-9, derived in
tests/conformance/common.py: a few SGD steps that amplify at most 10-fold, sums that cancel at most
100-fold). Clipping, g -> g min(1, 10 / ||g||), moves a difference in g by at most twice it, within
the SGD steps' amplification. Model entries are compared through fingerprints (a difference d moves each projection by
about |d|) with ``atol = 1e-9 x scale``, ``scale`` the norm of the terms the value is computed from
(n u sum|terms| is the rounding bound; the norms are the fixture's):

- trained weights y (own, shared, W_h): ||y||;
- an aggregate (the unweighted mean of the y_i): max ||y_i||;
- a compressed matrix (the rank-r truncation of y's SVD): ||y||. Both sides call LAPACK's SVD
  (``np.linalg.svd``) on arrays that differ by ~1e-15 ||y||; the truncation at a fixed rank moves by
  at most that times ||y||_2 / (sigma_r - sigma_{r+1}) (Wedin), and the rank is the same on both
  sides (every energy fraction lies at least 1e-4 from the energy: checked by the fixture maker), so
  that gap ratio would have to exceed 1e5 to reach 1e-9; the compression tests compare whole arrays
  to 1e-9 of their largest entry.

The losses: the mean over the steps, to ``FLOAT64``. The energies: to ``FLOAT64``.

A deliberately wrong setting (FML's joint clipping or alpha = 0.4, the weighted mean, FedKD's joint
clipping or a loss without its 1 / (CE + CE_g) scale, the other energy, the schedule one round off)
must miss the fixture by at least ``WRONG`` times the tolerance: the comparison can tell.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conformance.common import FLOAT64, assert_matches, fingerprint, load_fixture
from conformance.htfllib_mutual import (
    COMPRESSION_SHAPES,
    ENERGIES,
    NUM_CLASSES,
    NUM_CLIENTS,
    batch_order,
    client_x,
    hidden_map,
    names,
    own_model,
    sent_model,
)
from fakes import OK, FakeProxy, start_round
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays

from protofl.federation.wire import SEED, SERVER_ROUND, SHARED_LOSS, TRAIN_LOSS
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.families.second_model import MutualModels
from protofl.strategies.fedkd import FedKDOptions, fedkd_loss, low_rank
from protofl.strategies.fml import mutual_loss
from protofl.task.data import ClientData
from protofl.task.losses import mean_kl
from protofl.task.train import train

pytestmark = pytest.mark.conformance

WRONG = 1e3  # a wrong setting misses by at least this many tolerances


def _settings(method, given, tmp_path, **options) -> ExperimentSettings:
    if method == "fml":
        options = {"alpha": float(given["alpha"]), "beta": float(given["beta"])} | options
    else:
        options = {"energy-start": float(given["energy_start"]), "energy-end": float(given["energy_end"])} | options
    return ExperimentSettings(
        method=method, model="cnn", seed=int(given["init_seed"]), local_epochs=int(given["epochs"]),
        batch_size=int(given["batch_size"]), partial_batch="drop", lr=float(given["lr"]), momentum=0.0,
        weight_decay=0.0, max_grad_norm="auto", amp="off", channels_last=False, cuda_graphs="off",
        batchnorm_stats="running", output_dir=str(tmp_path), run_name="conformance", options=options,
    )


def _data(given, p) -> ClientData:
    x, y = client_x(given, p), torch.from_numpy(given[f"client{p}.labels"])
    return ClientData(p, NUM_CLASSES, x, y, x, y)  # (the test split is not used by fit)


def _tolerance(expected, scale=None) -> float:
    return FLOAT64["rtol"] * (expected[1] if scale is None else scale)


def _assert_fingerprint(array, expected, what, scale=None):
    """``array`` (ours) against the fingerprint of theirs, to 1e-9 of ``scale`` (default: its norm)."""
    assert_matches(fingerprint(array), expected, what, rtol=0.0, atol=_tolerance(expected, scale))


def _misses(array, expected, scale=None) -> float:
    """How many tolerances ``array``'s fingerprint lies from theirs."""
    return float(np.max(np.abs(fingerprint(array) - expected))) / _tolerance(expected, scale)


def _assert_whole(actual, expected, what):
    expected = np.asarray(expected)
    assert_matches(actual, expected, what, rtol=0.0, atol=FLOAT64["rtol"] * np.abs(expected).max())


def _arrays(module: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in module.parameters()]


def _assert_model(arrays, our_names, theirs, prefix):
    for name, array in zip(our_names, arrays):
        _assert_fingerprint(array, theirs[f"{prefix}.{name}"], f"{prefix} {name}")


def _one_round(method, case, tmp_path):
    """Our three clients' fit from the fixture's sent model and their own models, each client's
    trained models and losses compared with theirs, then our server's aggregate. Returns (fixture,
    our trained models by client, our uploads)."""
    fixture = load_fixture(f"htfllib-{method}-round-{case}")
    given, theirs = fixture.inputs, fixture.outputs
    settings = _settings(method, given, tmp_path)
    assert settings.train_arguments(1, 0, get_method(method)[0].options_class.from_settings(settings))[
        "max_grad_norm"] == 10.0
    data = {p: _data(given, p) for p in range(NUM_CLIENTS)}
    strategy_class, client_class = get_method(method)
    strategy = strategy_class(settings, build_method_model(settings, data[0]), NUM_CLASSES)
    assert strategy.options.weighted is False
    start_round(strategy, range(NUM_CLIENTS))
    sent_module = sent_model(method, given)
    shared_names = names(sent_module)
    sent = _arrays(sent_module)
    _assert_model(sent, shared_names, theirs, "initial.shared")
    strategy.admission.sent_parameters = sent
    results, trained, uploads = [], {}, {}
    for p in range(NUM_CLIENTS):
        prefix, seed = f"client{p}", int(given[f"client{p}.seed"])
        np.testing.assert_array_equal(batch_order(data[p].num_train, seed), given[f"{prefix}.order"])
        own = own_model(int(given["own_features"]), int(given["own_seed"]) + p)
        own_names = names(own)
        _assert_model(_arrays(own), own_names, theirs, f"{prefix}.initial.own")
        client = client_class(settings, data[p], own, NUM_CLIENTS, RecordDict())
        assert client.shared_names == shared_names
        seen = {}
        if method == "fedkd":  # W_h as our client draws it; the mentee before its compression
            receive, after_fit = client.receive, client.after_fit

            def spied_receive(parameters, config, client=client, receive=receive, seen=seen):
                receive(parameters, config)
                seen["initial_map"] = client.hidden_map.weight.detach().numpy().copy()

            def spied_after_fit(statistics, client=client, after_fit=after_fit, seen=seen):
                seen["shared"] = _arrays(client.exchanged)
                return after_fit(statistics)

            client.receive, client.after_fit = spied_receive, spied_after_fit
        sent_up, num_examples, metrics = client.fit(sent, {SERVER_ROUND: 1, SEED: seed})
        arrays = strategy.parameters_from_wire(sent_up)  # FedKD's matrices travel as factors
        _assert_model(_arrays(client.model), own_names, theirs, f"{prefix}.trained.own")
        shared = arrays if method == "fml" else seen["shared"]
        _assert_model(shared, shared_names, theirs, f"{prefix}.trained.shared")
        if method == "fedkd":
            _assert_fingerprint(seen["initial_map"], theirs["initial.hidden_map.weight"], f"{prefix} initial W_h")
            _assert_fingerprint(client.hidden_map.weight.detach().numpy(),
                                theirs[f"{prefix}.trained.hidden_map.weight"], f"{prefix} trained W_h")
            for name, array in zip(shared_names, arrays):  # the compressed mentee that goes up
                _assert_fingerprint(array, theirs[f"{prefix}.upload.{name}"], f"{prefix} upload {name}",
                                    theirs[f"{prefix}.trained.shared.{name}"][1])
        loss, shared_loss = theirs[f"{prefix}.loss"], theirs[f"{prefix}.loss_shared"]
        assert_matches(metrics[TRAIN_LOSS], (loss + shared_loss).mean(), f"{prefix} training loss")
        assert_matches(metrics[SHARED_LOSS], shared_loss.mean(), f"{prefix} shared model's loss")
        trained[p] = (client.model, shared, getattr(client, "hidden_map", None))
        uploads[p] = [a.copy() for a in arrays]
        results.append((FakeProxy(str(100 + p)), FitRes(OK, ndarrays_to_parameters(sent_up), num_examples, metrics)))
    parameters, summary = strategy.aggregate_fit(1, results, [])
    assert summary["accepted"] == NUM_CLIENTS
    key = "upload" if method == "fedkd" else "trained.shared"
    for name, array in zip(shared_names, strategy.parameters_from_wire(parameters_to_ndarrays(parameters))):
        scale = max(theirs[f"client{p}.{key}.{name}"][1] for p in range(NUM_CLIENTS))
        _assert_fingerprint(array, theirs[f"aggregate.{name}"], f"aggregate {name}", scale)
    return fixture, trained, uploads


def _pure_round(method, given, p, *, joint_clip=False, alpha=None, unscaled=False):
    """Client p's models trained by :func:`train` directly (the pieces our client calls): the
    ``MutualModels`` of its own model, the shared one (and FedKD's W_h), the method's loss; each
    module clipped on its own unless ``joint_clip``. Returns the trained modules."""
    own = own_model(int(given["own_features"]), int(given["own_seed"]) + p)
    shared = sent_model(method, given)
    modules = [own, shared]
    if method == "fml":
        a, b = (float(given["alpha"]) if alpha is None else alpha), float(given["beta"])

        def loss(inputs, features, logits, labels):
            _, shared_logits = shared(inputs)
            return mutual_loss(logits, shared_logits, labels, a) + mutual_loss(shared_logits, logits, labels, b)
    else:
        w_h = hidden_map(int(given["init_seed"]))
        modules.append(w_h)

        def loss(inputs, features, logits, labels):
            shared_features, shared_logits = shared(inputs)
            if unscaled:  # (wrong) the distillation and hidden losses without 1 / (CE + CE_g)
                hidden = F.mse_loss(features, w_h(shared_features))
                return (F.cross_entropy(logits, labels) + F.cross_entropy(shared_logits, labels)
                        + mean_kl(logits, shared_logits) + mean_kl(shared_logits, logits) + 2 * hidden)
            return fedkd_loss(features, logits, shared_features, shared_logits, labels, w_h)[0]

    groups = None if joint_clip else [list(m.parameters()) for m in modules]
    train(MutualModels(*modules), client_x(given, p), torch.from_numpy(given[f"client{p}.labels"]),
          epochs=int(given["epochs"]), batch_size=int(given["batch_size"]), lr=float(given["lr"]),
          seed=int(given[f"client{p}.seed"]), max_grad_norm=10.0, clip_groups=groups, loss=loss)
    return modules


def _misses_model(module, our_names, theirs, prefix) -> float:
    return max(_misses(a, theirs[f"{prefix}.{n}"]) for n, a in zip(our_names, _arrays(module)))


def _check_pure_and_wrong(method, fixture, wrong):
    """The pieces through :func:`train` agree with their client 0 as our client does; ``wrong``
    (keyword arguments of :func:`_pure_round`) misses by at least ``WRONG`` tolerances."""
    given, theirs = fixture.inputs, fixture.outputs
    labels = ("own", "shared", "hidden_map")
    right = _pure_round(method, given, 0)
    for label, module in zip(labels, right):
        _assert_model(_arrays(module), names(module), theirs, f"client0.trained.{label}")
    missed = _pure_round(method, given, 0, **wrong)
    misses = [_misses_model(m, names(m), theirs, f"client0.trained.{label}") for label, m in zip(labels, missed)]
    assert min(misses[:2]) >= WRONG  # the own model and the shared one


@pytest.mark.parametrize("case", ["plain", "clipped"])
def test_fml_round_equals_htfllib(case, tmp_path):
    """Each step: both models on the gradient of L_own + L_meme, L = w CE + (1 - w) KL (their two
    backward passes), each model's gradient clipped to 10 on its own (``clipped``: every client's
    both models are, at some step), one SGD step each; the server's unweighted mean of the memes.
    Wrong: the two models clipped jointly (``clipped``) or alpha 0.4 (``plain``); the weighted mean."""
    fixture, trained, uploads = _one_round("fml", case, tmp_path)
    theirs = fixture.outputs
    norms = np.stack([theirs[f"client{p}.clip_norms"].max(axis=0) for p in range(NUM_CLIENTS)])
    assert (norms > 10).all() if case == "clipped" else (norms < 10).all()
    _check_pure_and_wrong("fml", fixture, {"joint_clip": True} if case == "clipped" else {"alpha": 0.4})
    sizes = [len(fixture.inputs[f"client{p}.labels"]) for p in range(NUM_CLIENTS)]
    shared_names = names(sent_model("fml", fixture.inputs))
    weighted = [np.average(np.stack(layer), axis=0, weights=sizes) for layer in zip(*uploads.values())]
    scale = {n: max(theirs[f"client{p}.trained.shared.{n}"][1] for p in range(NUM_CLIENTS)) for n in shared_names}
    assert max(_misses(a, theirs[f"aggregate.{n}"], scale[n]) for n, a in zip(shared_names, weighted)) >= WRONG


@pytest.mark.parametrize("case", ["plain", "clipped"])
def test_fedkd_round_equals_htfllib(case, tmp_path):
    """Each step: mentor, mentee and W_h on the gradient of L_mentor + L_mentee (CE + KL / (CE +
    CE_g) + MSE(h_t, W_h h_s) / (CE + CE_g) each), each module clipped to 10 on its own (``clipped``:
    the mentor's and the mentee's are, W_h's gradient stays under 10); the mentee uploaded
    compressed at energy 0.95; the server's unweighted mean compressed at 0.95. Wrong: jointly
    clipped (``clipped``) or without the 1 / (CE + CE_g) scale (``plain``)."""
    fixture, _, _ = _one_round("fedkd", case, tmp_path)
    theirs = fixture.outputs
    norms = np.stack([theirs[f"client{p}.clip_norms"].max(axis=0) for p in range(NUM_CLIENTS)])
    assert (norms[:, :2] > 10).all() if case == "clipped" else (norms < 10).all()
    _check_pure_and_wrong("fedkd", fixture, {"joint_clip": True} if case == "clipped" else {"unscaled": True})


def test_fedkd_compression_equals_htfllib():
    """``low_rank`` = their ``recover(decomposition(...))`` on a matrix, 3 x 3 and 5 x 5 convolution
    weights (one rank for all kernels), a bias and a one-row matrix (both as they are), at 0.95 and
    0.98. Wrong: the other energy (the matrix's and the 5 x 5 kernels' ranks differ)."""
    fixture = load_fixture("htfllib-fedkd-compression")
    given, theirs = fixture.inputs, fixture.outputs
    for energy in ENERGIES:
        for name in COMPRESSION_SHAPES:
            if name == "flat":  # test_fedkd_flat_spectrum_differs_from_htfllib
                continue
            array = given[f"single.{name}"]
            ours = low_rank(array, energy)
            _assert_whole(ours, theirs[f"{energy}.{name}"], f"{name} at {energy}")
            if name in ("bias", "row"):
                np.testing.assert_array_equal(ours, array)
            else:
                assert np.linalg.matrix_rank(ours[(0,) * (array.ndim - 2)]) == int(theirs[f"{energy}.{name}.rank"])
    for name in ("matrix", "conv5"):
        low, high = ENERGIES
        wrong = low_rank(given[f"single.{name}"], high)
        expected = theirs[f"{low}.{name}"]
        assert np.abs(wrong - expected).max() >= WRONG * FLOAT64["rtol"] * np.abs(expected).max()


def test_fedkd_server_step_equals_htfllib():
    """The server's step: the mean of the clients' compressed uploads (ours arrive as the low-rank
    arrays their ``recover`` rebuilds), compressed again at the round's energy (their
    ``FedKD.aggregate_parameters``). Wrong: the mean left uncompressed."""
    fixture = load_fixture("htfllib-fedkd-compression")
    given, theirs = fixture.inputs, fixture.outputs
    energy = float(given["server.energy"])
    missed = []
    for name in COMPRESSION_SHAPES:
        if name == "flat":
            continue
        uploads = [low_rank(given[f"client{p}.{name}"], energy) for p in range(NUM_CLIENTS)]
        mean = np.mean(uploads, axis=0)
        expected = theirs[f"server.{name}"]
        _assert_whole(low_rank(mean, energy), expected, f"server {name}")
        missed.append(np.abs(mean - expected).max() / (FLOAT64["rtol"] * np.abs(expected).max()))
    assert max(missed) >= WRONG


def test_fedkd_flat_spectrum_differs_from_htfllib():
    """A documented difference: where no truncation below full rank reaches the energy (four equal
    singular values: 0.25, 0.5, 0.75 of the energy), HtFLlib's ``decomposition`` keeps rank 0, so
    the matrix arrives as zeros; ours keeps it whole."""
    fixture = load_fixture("htfllib-fedkd-compression")
    flat = fixture.inputs["single.flat"]
    for energy in ENERGIES:
        assert int(fixture.outputs[f"{energy}.flat.rank"]) == 0
        assert not fixture.outputs[f"{energy}.flat"].any()  # theirs: zeros
        _assert_whole(low_rank(flat, energy), flat, f"ours at {energy}")  # ours: the input (its SVD rebuilt)


def test_fedkd_energy_schedule_equals_htfllib(tmp_path):
    """Their round i (0-based; their loop runs global_rounds + 1 of them) compresses at T_start +
    i / global_rounds (T_end - T_start) on the clients and the server: ours
    ``FedKDOptions.energy(i + 1)`` with ``energy-rounds = global_rounds``. Wrong: one round off."""
    fixture = load_fixture("htfllib-fedkd-energy")
    given, theirs = fixture.inputs, fixture.outputs
    rounds = int(given["global_rounds"])
    settings = ExperimentSettings(method="fedkd", output_dir=str(tmp_path), options={
        "energy-start": float(given["energy_start"]), "energy-end": float(given["energy_end"]), "energy-rounds": rounds})
    options = FedKDOptions.from_settings(settings)
    np.testing.assert_array_equal(theirs["client_energy"], theirs["server_energy"])
    ours = [options.energy(i + 1) for i in range(rounds + 1)]
    assert_matches(ours, theirs["server_energy"], "energy by round")
    assert ours[-1] == pytest.approx(float(given["energy_end"]))
    wrong = np.array([options.energy(i) for i in range(rounds + 1)])
    assert np.abs(wrong - theirs["server_energy"]).max() >= WRONG * FLOAT64["rtol"]
