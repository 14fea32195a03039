"""pFedMe, Per-FedAvg and FedAMP against numbers PFLlib's code (TsingZ0/PFLlib) computed on the same
inputs: the two rounds of tests/test_conformance_baselines.py (four clients, rounds of clients 0-2
and 1-3, our ``cnn``, plain SGD, float64), our clients and server in place of theirs.

The fixtures (tests/conformance/fixtures/{pfedme,perfedavg,fedamp}-pfllib-rounds.npz) and the calls
that made them are described in tests/conformance/pfllib_personal.py; their code is not run here.
Our options are the values their code ran with (``OPTIONS``): pFedMe's mu their optimiser's 0.001,
FedAMP's term PFLlib's (``proximal = "pfllib"``: a value without a gradient).

Tolerances: as in tests/test_conformance_baselines.py, ``FLOAT64`` of the scale of the terms a value
is computed from (the fingerprints' norms): theta and w, ||theta|| and ||w||; pFedMe's mixed aggregate
(1 - beta) x + beta mean(w_i), ||x|| + max ||w_i||; FedAMP's u_i = xi_ii w_i + sum xi_ij w_j (weights
at most 1 in size, sum(|xi|) <= 1 + 2 |1 - xi_ii| here), the sum of the models' norms.
"""

import io

import numpy as np
import pytest
from flwr.app import RecordDict
from conformance.common import FLOAT64, assert_matches, load_fixture
from conformance.pfllib_baselines import NUM_CLIENTS, ROUNDS, names
from test_conformance_baselines import _assert_fingerprint, _data, _norm, _settings, _two_rounds

from protofl.strategies import build_method_model, get_method
from protofl.strategies.fedamp import CLIENT_MODEL, attention_weights
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
