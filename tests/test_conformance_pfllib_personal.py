"""pFedMe, Per-FedAvg, FedAMP and Local against numbers PFLlib's code (TsingZ0/PFLlib) computed on
the same inputs: the two rounds of tests/test_conformance_baselines.py (four clients, rounds of
clients 0-2 and 1-3, our ``cnn``, plain SGD, float64), our clients and server in place of theirs.

The fixtures (tests/conformance/fixtures/{pfedme,perfedavg,fedamp}-pfllib-rounds.npz) and the calls
that made them are described in tests/conformance/pfllib_personal.py; their code is not run here.
Our options are the values their code ran with (``OPTIONS``): pFedMe's mu their optimiser's 0.001,
FedAMP's term PFLlib's (``proximal = "pfllib"``: a value without a gradient). FedAMP's default,
the paper's squared term, has no reference code: one client round of it is compared with its steps
derived by hand in float64 (``test_fedamp_default_squared_term_equals_the_papers_steps``).

Local has no fixture of its own: FedAMP's run is PFLlib's Local (d832e76's ``serverlocal.Local``:
``clientAVG.train``, plain SGD on cross-entropy with clientbase's ``SGD(lr)``, each client's model
kept across rounds, nothing sent, nothing aggregated). Their FedAMP client steps that same
optimiser on the same batches; its term, computed on the weights' ``.data``, has no gradient
(``make`` checks that lamda 1 and 1000 train the same weights to the bit), and their
``send_models`` changes only ``client_u``, never ``c.model``. So each FedAMP client trains its own
model from where it last was (client 3 in round 2: from its initial copy), and their trained
models and cross-entropies (``.trained``, ``.ce``) are Local's.

Tolerances: as in tests/test_conformance_baselines.py, ``FLOAT64`` of the scale of the terms a value
is computed from (the fingerprints' norms): theta and w, ||theta|| and ||w||; pFedMe's mixed aggregate
(1 - beta) x + beta mean(w_i), ||x|| + max ||w_i||; FedAMP's u_i = xi_ii w_i + sum xi_ij w_j (weights
at most 1 in size, sum(|xi|) <= 1 + 2 |1 - xi_ii| here), the sum of the models' norms.
"""

import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict
from conformance.common import FLOAT64, assert_matches, load_fixture
from conformance.pfllib_baselines import NUM_CLIENTS, ROUNDS, batch_order, names
from test_conformance_baselines import _assert_fingerprint, _data, _norm, _settings, _two_rounds
from torch import nn

from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, PROXIMAL_LOSS, TRAIN_LOSS, encode_array, indexed
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.strategies.fedamp import CLIENT_MODEL, CLOUD_MODEL, FedAMPClient, attention_weights
from protofl.task.data import ClientData
from protofl.task.models import SplitModel
from protofl.task.weights import all_tensors

pytestmark = pytest.mark.conformance


def _given(method):
    return load_fixture(f"{method}-pfllib-rounds").inputs


OPTIONS = {
    "pfedme": lambda g: {"lambda": float(g["their.lamda"]), "k": int(g["their.K"]),
                         "personal-lr": float(g["their.p_learning_rate"]), "beta": float(g["their.beta"]),
                         "mu": float(g["their.mu"])},
    "perfedavg": lambda g: {"alpha": float(g["their.alpha"]), "beta": float(g["their.beta"])},
    "fedamp": lambda g: {"alpha-k": float(g["their.alphaK"]), "lambda": float(g["their.lamda"]),
                         "sigma": float(g["their.sigma"]), "proximal": "pfllib", "peer-weight-bound": False},
}


@pytest.mark.slow  # 4-6 s: in the slow suite and the conformance runs (`pytest -m conformance`)
def test_pfedme_two_rounds_equal_pfllib(tmp_path):
    """K inner steps of theta per batch towards the Moreau envelope's minimiser, w <- w - eta lambda
    (w - theta) after each batch, w uploaded, theta kept; the server's beta-mixed weighted average."""
    theirs = load_fixture("pfedme-pfllib-rounds").outputs

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        for name, tensor in all_tensors(client.model).items():  # theta, the personalised model kept
            _assert_fingerprint(tensor.detach().numpy(), theirs[f"{prefix}.personal.{name}"], f"{prefix} theta {name}")

    _two_rounds("pfedme", tmp_path, check_client, options=OPTIONS["pfedme"](_given("pfedme")),
                expected_loss=lambda prefix: theirs[f"{prefix}.ce"].mean())


def test_perfedavg_two_rounds_and_the_adaptation_step_equal_pfllib(tmp_path):
    """Each step: w' = w - alpha grad f(w; D), then w <- w - beta grad f(w'; D') on the halves of a
    batch of 2B; FedAvg; at evaluation one step at alpha on the first B of the scored round's order."""
    fixture = load_fixture("perfedavg-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    options = OPTIONS["perfedavg"](given)
    aggregate = _two_rounds(
        "perfedavg", tmp_path, options=options,
        expected_loss=lambda prefix: np.r_[theirs[f"{prefix}.inner_ce"], theirs[f"{prefix}.outer_ce"]].mean())
    settings = _settings("perfedavg", given, tmp_path, options)
    _, client_class = get_method("perfedavg")
    for p in range(NUM_CLIENTS):
        data = _data(given, p)
        client = client_class(settings, data, build_method_model(settings, data), NUM_CLIENTS, RecordDict())
        seed = int(given[f"eval.client{p}.seed"])
        client.prepare_evaluation(aggregate, client.round_of({"server-round": len(ROUNDS) + 1, "seed": seed}))
        for name, tensor in all_tensors(client.model).items():
            _assert_fingerprint(tensor.detach().numpy(), theirs[f"eval.client{p}.adapted.{name}"],
                                f"client {p} adapted {name}")


def test_fedamp_two_rounds_equal_pfllib(tmp_path):
    """Each client trains its own model (PFLlib's term carries no gradient) and uploads it; in round
    2 the server sends each its u_i = xi_ii w_i + sum_j xi_ij w_j over the round-1 models."""
    fixture = load_fixture("fedamp-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        for i, name in enumerate(names(client.model)):
            uploaded = np.load(io.BytesIO(metrics[f"{CLIENT_MODEL}/{i}"]))
            _assert_fingerprint(uploaded, theirs[f"{prefix}.trained.{name}"], f"{prefix} w_i {name}")
            _assert_fingerprint(client.cloud[i].numpy(), theirs[f"{prefix}.u.{name}"], f"{prefix} u_i {name}",
                                scale=sum(_norm(theirs, f"round1.client{q}.trained", name) for q in ROUNDS[1])
                                + _norm(theirs, "initial", name))

    _two_rounds("fedamp", tmp_path, check_client, options=OPTIONS["fedamp"](given))


def test_fedamp_attention_weights_equal_pfllib(tmp_path):
    """xi_ij = alpha_k exp(-||w_i - w_j||^2 / sigma) / sigma from their round-2 distances, and xi_ii."""
    fixture = load_fixture("fedamp-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs

    for p in ROUNDS[2]:
        distances = theirs[f"round2.client{p}.sq_distance"]
        others = [j for j, q in enumerate(theirs["round1.uploaded_ids"]) if q != p]
        xi, xi_own = attention_weights(distances[others], float(given["their.alphaK"]), float(given["their.sigma"]),
                                       bounded=False)
        assert_matches(xi, theirs[f"round2.client{p}.coef"][others], f"client {p} xi", **FLOAT64)
        assert_matches(xi_own, theirs[f"round2.client{p}.coef_self"], f"client {p} xi_ii", **FLOAT64)


def test_local_two_rounds_equal_pfllib_fedamp_training(tmp_path):
    """LocalClient.fit through the two rounds of fedamp-pfllib-rounds: each client's model trained
    with plain SGD on cross-entropy from where it was (round 2: clients 1 and 2 from their round-1
    models, restored from their node's store; client 3 from the initial model), compared with
    PFLlib's trained models (``.trained``) and cross-entropy (``.ce``, the mean over the steps);
    nothing shared, no class statistics uploaded, nothing aggregated."""
    theirs = load_fixture("fedamp-pfllib-rounds").outputs

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        for name, tensor in all_tensors(client.model).items():
            _assert_fingerprint(tensor.detach().numpy(), theirs[f"{prefix}.trained.{name}"], f"{prefix} trained {name}")
        assert CLASS_MEANS not in metrics and CLASS_COUNTS not in metrics  # no class statistics
        assert not any(key.startswith(CLIENT_MODEL) for key in metrics)  # (FedAMP's upload: not Local's)

    aggregate = _two_rounds("local", tmp_path, check_client, options={}, fixture="fedamp",
                            expected_loss=lambda prefix: theirs[f"{prefix}.ce"].mean())
    assert aggregate == []


# --- FedAMP's default term, which no reference implements: a float64 hand derivation -------------

def _fedamp_hand_steps(model, x, y, order, batch_size, lr, factor, cloud):
    """The paper's local steps written out: on each batch, loss = CE + factor ||w - u||^2 / 2 (factor
    = lambda / alpha_k, so the term is lambda / (2 alpha_k) ||w - u||^2) and w <- w - lr (grad CE +
    factor (w - u)). grad CE comes from torch.autograd on ``model`` (a copy, loaded with w each
    step); the proximal term and its gradient are numpy. Returns (w, losses, proximal terms)."""
    parameters = list(model.parameters())
    w = [p.detach().numpy().copy() for p in parameters]
    losses, proximal = [], []
    for start in range(0, len(order) - batch_size + 1, batch_size):
        batch = order[start:start + batch_size]
        with torch.no_grad():
            for p, value in zip(parameters, w):
                p.copy_(torch.from_numpy(value))
        ce = F.cross_entropy(model(torch.from_numpy(x[batch]))[1], torch.from_numpy(y[batch]))
        gradient = [g.numpy() for g in torch.autograd.grad(ce, parameters)]
        term = sum(float(np.sum((a - u) ** 2)) for a, u in zip(w, cloud)) / 2
        losses.append(ce.item() + factor * term)
        proximal.append(term)
        w = [a - lr * (g + factor * (a - u)) for a, g, u in zip(w, gradient, cloud)]
    return w, np.array(losses), np.array(proximal)


def test_fedamp_default_squared_term_equals_the_papers_steps(tmp_path):
    """FedAMPClient.fit with the default ``proximal = "squared"`` (the paper's; no code implements it,
    PFLlib's is a norm without a gradient): two SGD steps on CE + lambda / (2 alpha_k) ||w - u||^2
    towards the received cloud model u, against the same steps derived by hand in float64; the
    uploaded and kept w, the training loss and the reported ||w - u||^2 / 2, each a batch mean.

    Tolerances: ``FLOAT64`` (one formula in another order, two steps), the absolute part 1e-9 x the
    larger of the weights' and their displacement's largest entry (tests/conformance/common.py). A
    halved, dropped or mis-scaled term (lambda alone, lambda alpha_k, 2 lambda / alpha_k) moves the
    weights by lr x its change x |w - u|, checked here to be over 1e6 tolerances."""
    alpha_k, lam, lr, seed, batch_size = 0.4, 0.3, 0.1, 5, 4
    factor = lam / alpha_k  # 0.75: apart from the mis-scalings 0.3, 0.12, 0.375, 1.5
    settings = ExperimentSettings(method="fedamp", seed=0, local_epochs=1, batch_size=batch_size,
                                  partial_batch="drop", lr=lr, amp="off", channels_last=False, cuda_graphs="off",
                                  batchnorm_stats="running", output_dir=str(tmp_path), run_name="conformance",
                                  options={"alpha-k": alpha_k, "lambda": lam})
    torch.manual_seed(0)
    model = SplitModel(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 4), 8)
    reference = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)), rng.integers(0, 4, 8)
    start = [p.detach().numpy().copy() for p in model.parameters()]
    cloud = [a + 0.2 * rng.standard_normal(a.shape) for a in start]  # u != w: the term pulls from step 1
    client = FedAMPClient(settings, ClientData(0, 4, torch.from_numpy(x), torch.from_numpy(y),
                                               torch.from_numpy(x), torch.from_numpy(y)), model, 1, {})
    assert client.options.proximal == "squared"
    config = {"server-round": 2, "seed": seed} | {k: encode_array(v) for k, v in indexed(CLOUD_MODEL, cloud).items()}
    arrays, num_examples, metrics = client.fit([], config)
    assert (arrays, num_examples) == ([], 8)  # nothing on the parameters channel
    eta = settings.round_lr(2)
    w, losses, proximal = _fedamp_hand_steps(reference, x, y, batch_order(8, seed), batch_size, eta, factor, cloud)
    kept = [p.detach().numpy() for p in client.model.parameters()]
    tolerances = [FLOAT64["rtol"] * max(np.abs(e).max(), np.abs(e - s).max()) for e, s in zip(w, start)]  # atol
    for i, (expected, atol) in enumerate(zip(w, tolerances)):
        uploaded = np.load(io.BytesIO(metrics[f"{CLIENT_MODEL}/{i}"]))
        assert_matches(uploaded, expected, f"the uploaded w, parameter {i}", rtol=FLOAT64["rtol"], atol=atol)
        assert_matches(kept[i], expected, f"the kept w, parameter {i}", rtol=FLOAT64["rtol"], atol=atol)
    assert_matches(metrics[TRAIN_LOSS], losses.mean(), "the training loss, CE + lambda / (2 alpha_k) ||w - u||^2")
    assert_matches(metrics[PROXIMAL_LOSS], proximal.mean(), "the reported ||w - u||^2 / 2")
    for wrong in (factor / 2, 0.0, lam, lam * alpha_k, 2 * factor):  # the test tells each of these apart
        other, _, _ = _fedamp_hand_steps(reference, x, y, batch_order(8, seed), batch_size, eta, wrong, cloud)
        apart = max(float(np.max(np.abs(a - e) / (atol + FLOAT64["rtol"] * np.abs(e))))
                    for a, e, atol in zip(other, w, tolerances))
        assert apart > 1e6, f"lambda / alpha_k = {wrong} is within 1e6 tolerances of {factor}"
