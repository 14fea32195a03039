"""FedALA and FedPAC against numbers PFLlib's code (TsingZ0/PFLlib) computed on the same inputs: the
two rounds of tests/test_conformance_baselines.py (four clients, rounds of clients 0-2 and 1-3, our
``cnn``, plain SGD, float64), our clients and server in place of theirs.

The fixtures (tests/conformance/fixtures/{fedala,fedpac}-pfllib-rounds.npz) and the calls that made
them are described in tests/conformance/pfllib_adaptive.py; their code is not run here. FedALA's slice
start is our rule (:func:`~protofl.strategies.fedala.slice_start`), patched into their draw; FedPAC's
clients hold 8, 12, 8 and 4 samples (their statistics and prototypes skip a partial batch), its
prototypes cross our float32 wire on both sides, and its fixture sidesteps two slips of their server
(the docstring there): the heads are those FedPAC's equations give.

Tolerances: ``FLOAT64`` of the terms' scale, as in tests/test_conformance_baselines.py; FedPAC's
global prototypes, means of float32 values rounded to float32 on both sides, to one float32 rounding
of their size (2^-24 relative); its QP weights to 1e-9 of their sum (1): cvxpy's OSQP answer is the
exact minimiser to 1e-16 there (pfllib_adaptive.py), ours is exact up to rounding.
"""

import io

import numpy as np
import pytest
from conformance.common import FLOAT32_ROUNDING, FLOAT64, assert_matches, load_fixture
from conformance.pfllib_baselines import ROUNDS, names
from test_conformance_baselines import _assert_fingerprint, _norm, _two_rounds

from protofl.strategies.fedala import BLEND_WEIGHTS, slice_start
from protofl.strategies.fedpac import CENTROIDS, VARIANCE, combination_matrix, combination_weights

pytestmark = pytest.mark.conformance


@pytest.mark.slow  # 4-6 s: in the slow suite and the conformance runs (`pytest -m conformance`)
def test_fedala_two_rounds_equal_pfllib(tmp_path):
    """Round 1 skips the blend (local = global); in round 2 each client learns W on its slice (the
    start phase: epochs until the loss settles) and trains from theta_hat; FedAvg."""
    fixture = load_fixture("fedala-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        n = client.data.num_train
        assert slice_start(n, int(0.8 * n), int(given[f"{prefix}.seed"])) == int(theirs[f"{prefix}.ala_start"])
        for i in range(2 if r == 2 else 0):
            _assert_fingerprint(client.local_state[f"{BLEND_WEIGHTS}{i}"], theirs[f"{prefix}.weights.{i}"],
                                f"{prefix} W {i}")

    _two_rounds("fedala", tmp_path, check_client,
                options={"eta": float(given["their.eta"]), "sample-percent": float(given["their.rand_percent"]),
                         "blended-tensors": int(given["their.layer_idx"])},
                expected_loss=lambda prefix: theirs[f"{prefix}.ce"].mean())


@pytest.mark.slow  # 4-6 s: in the slow suite and the conformance runs (`pytest -m conformance`)
def test_fedpac_two_rounds_equal_pfllib(tmp_path):
    """V_i and h_i of the received body; a head epoch, then the body with lambda MSE to the global
    prototypes; the server's body average, unweighted prototype means, and each client's head
    combined by the simplex QP's weights."""
    fixture = load_fixture("fedpac-pfllib-rounds")
    given, theirs = fixture.inputs, fixture.outputs
    uploads = {}

    def check_client(r, p, client, metrics, sent_prefix):
        prefix = f"round{r}.client{p}"
        variance = np.load(io.BytesIO(metrics[VARIANCE]))[0]
        centroids = np.load(io.BytesIO(metrics[CENTROIDS]))
        assert_matches(variance, theirs[f"{prefix}.V"], f"{prefix} V")
        assert_matches(centroids, theirs[f"{prefix}.h"], f"{prefix} h", rtol=0.0,
                       atol=FLOAT64["rtol"] * np.abs(theirs[f"{prefix}.h"]).max())
        uploads[r, p] = (variance, centroids)

    def check_server(r, strategy, sent_prefix):
        clients = ROUNDS[r]
        expected = theirs[f"round{r}.global_protos"]
        held = ~np.isnan(expected).all(axis=1)
        np.testing.assert_array_equal(strategy.global_prototypes.mask, held)
        assert_matches(strategy.global_prototypes.vectors[held], expected[held], f"round {r} global prototypes",
                       rtol=0.0, atol=FLOAT32_ROUNDING * np.abs(expected[held]).max())
        variances = np.array([uploads[r, p][0] for p in clients])
        centroids = np.stack([uploads[r, p][1] for p in clients])
        for i, p in enumerate(clients):
            matrix = combination_matrix(i, variances, centroids)
            their_matrix = theirs[f"round{r}.client{p}.qp_matrix"]
            assert_matches(matrix, their_matrix, f"round {r} client {p} QP matrix", rtol=0.0,
                           atol=FLOAT64["rtol"] * np.abs(their_matrix).max())
            assert_matches(combination_weights(matrix), np.abs(theirs[f"round{r}.head_weights"][i]),
                           f"round {r} client {p} head weights", rtol=0.0, atol=FLOAT64["rtol"])
            made, head = strategy.combined_heads[p]
            assert made == r
            for array, name in zip(head, names(strategy.model)[-2:]):
                scale = sum(_norm(theirs, f"round{r}.client{q}.trained", name) for q in clients)
                _assert_fingerprint(array, theirs[f"round{r}.client{p}.new_head.{name}"],
                                    f"round {r} client {p} combined head {name}", scale)

    _two_rounds("fedpac", tmp_path, check_client, check_server, options={"lambda": float(given["their.lamda"])},
                expected_loss=lambda prefix: theirs[f"{prefix}.body_loss"].mean())
