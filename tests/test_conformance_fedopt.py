"""FedOpt against Flower's own FedAdam, FedYogi and FedAdagrad (flwr.server.strategy, run live here:
a dependency of protofl, not copied code).

``form = "flower"``: protofl's server update must be Flower's strategy's, round after round (4
rounds; 3 on the digits CNN: the moments and FedAdam's bias correction, which Flower computes with
``server_round + 1``, matter), both fed the same client replies: unequal training sizes (the mean is
weighted), each client's parameters protofl's last broadcast plus its own noise (they differ
between clients and rounds), protofl's ``admission.sent_parameters`` set to what it returned the
round before (what ``configure_fit`` sets in a real run). Flower's FedAdagrad has no momentum
(beta_1 = 0): protofl's flower-form adagrad leaves out its ``beta1`` too, so that it matches with the
default options (0.9). ``form = "paper"`` (the default, Algorithm 2 as printed) differs from
Flower's exactly where documented in protofl/strategies/fedopt.py: the uniform mean of the clients
instead of the sample-weighted one, v from tau^2 instead of 0, no Adam bias correction; checked by
undoing each of the three on Flower's side (equal num_examples, its v_t started at tau^2, its eta
divided by the round's correction) and finding the paper form then, and only then, within
tolerance; by the paper form's adagrad with equal sizes and a tiny tau being Flower's FedAdagrad;
and by one entry computed by hand over two rounds for each optimiser (and FedAdam's form).

The server rule works entry by entry, so most tests run a narrowed copy of the digits CNN (2.6k
entries, fast); one runs the model protofl builds for digits (90k entries).

Tolerance. Both sides compute in float64 (tests/conftest.py: the model's weights are float64), so
what is compared is the math (tests/conformance/common.py). The two differ in one place only: the
weighted mean of the clients' parameters. Flower's ``aggregate_inplace`` scales each client's
arrays by n_i / N and adds them in arrival order; protofl's ``weighted_average`` normalises the
weights and sums with ``np.tensordot`` (its own order) over the clients sorted by partition. Two
such sums of n = 4 terms differ by at most (n + 1) u sum_i w_i |x_i| <= 5 u X per entry (u = 2^-53,
X the largest |parameter|: common.py's n u sum|terms|), and Delta_t = mean - x_t adds one rounding:
eps <= 6 u X. After Delta_t both apply the same elementwise formulas in the same order (m, v, the
step; FedAdam's correction eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)) too), identical given
the same Delta_t (but for yogi's sign(v - Delta^2), which would flip on an entry within a rounding
of v = Delta^2: none does here, or the comparison would show a jump of 2 (1 - beta2) Delta^2 in v).
An error d in Delta_t, or in x_t, which enters Delta_(t+1), moves the step
eta c m / (sqrt(v) + tau) by at most K eta d / tau, with K = c ((1 - beta1) + L R) <= 2 (c <= 1 the
bias correction; L <= 1 the slope of sqrt(v) in Delta; R = |m| / sqrt(v) <= 3 with L <= 0.23 for
adam and yogi at beta2 = 0.95, R, L <= 1 for adagrad without momentum), so each round multiplies the
error so far by at most A = 1 + K eta / tau. With eta / tau <= 10 here (A <= 21) and T = 4 rounds
the parameters differ by at most eps A^T <= 6 u X 21^4 = 1.3e-10 X: within common.py's float64
budget, rtol 1e-9, applied to the parameters' scale (atol 1e-9 X: the errors are absolute, of the
size of X's roundings, not relative to an entry near 0). A formula that differs shows at 1e-4 X or
more (a step moves the parameters by 2-4% of X; each documented difference, measured, by 0.7-5%).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conformance.common import FLOAT64
from fakes import OK, FakeProxy
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAdagrad, FedAdam, FedYogi
from torch import nn

from protofl.federation.partitions import PartitionClaim
from protofl.federation.server import legacy_strategy
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model
from protofl.strategies.fedopt import FedOptStrategy
from protofl.task.data.clients import ClientData, PartitionSizes
from protofl.task.models import SplitModel

pytestmark = pytest.mark.conformance

N = 4
SIZES = (120, 45, 300, 75)  # training sizes: unequal, so Flower's weighting matters
EQUAL = (150, 150, 150, 150)
ROUNDS = 4
SPREAD = 0.01  # the std of a client's change to each parameter (the initial weights are up to 0.2)
ARRIVAL = (2, 0, 3, 1)  # the replies' order (protofl sorts them by partition, Flower does not)
# eta / tau <= 10 (the module's bound), and sqrt(v) (about 1e-3 for adam and yogi, 5e-3 to 1e-2 for
# adagrad) near tau, so that v matters; beta1, beta2 not protofl's defaults, so they must be passed.
SETTINGS = {
    "adam": {"eta": 0.01, "tau": 1e-3, "beta1": 0.8, "beta2": 0.95},
    "yogi": {"eta": 0.01, "tau": 1e-3, "beta1": 0.8, "beta2": 0.95},
    "adagrad": {"eta": 0.01, "tau": 1e-2, "beta1": 0.0, "beta2": 0.95},  # FedAdagrad: beta_1 = 0, no beta_2
}
FLOWER = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}
RTOL = FLOAT64["rtol"]  # the module's bound: 1.3e-10 X < 1e-9 X


def small_cnn() -> SplitModel:
    """The digits CNN's layers, narrowed (2.6k entries instead of 90k: the tests that need no full
    model run 30 times faster; the server rule is the same per entry)."""
    body = nn.Sequential(nn.Conv2d(1, 4, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 16), nn.ReLU())
    return SplitModel(body, nn.Linear(16, 10), 16)


def make_strategy(tmp_path, sizes=SIZES, full_model=False, **options) -> FedOptStrategy:
    """protofl's FedOpt after discovery, as tests/replies.py's ``make_strategy`` builds one:
    nodes 100..103 claim partitions 0..3 of training sizes ``sizes``, each believed. The model: the
    digits CNN protofl builds (``full_model``), or :func:`small_cnn`."""
    settings = ExperimentSettings(method="fedopt", model="cnn", output_dir=str(tmp_path), run_name="fedopt",
                                  min_fit_clients=2, options=options)
    shapes = ClientData(0, 10, torch.zeros(1, 1, 28, 28), torch.zeros(1, dtype=torch.long),
                        torch.zeros(1, 1, 28, 28), torch.zeros(1, dtype=torch.long))  # digits' shapes
    model = build_method_model(settings, shapes) if full_model else small_cnn()

    def expected(num_partitions, pid):  # the server's own sizes of a partition
        return PartitionSizes(np.bincount(np.arange(sizes[pid]) % 10, minlength=10).astype(np.int64), 50)

    strategy = legacy_strategy(FedOptStrategy)(settings, model, 10, partition_sizes=expected)
    assert {w.dtype for w in strategy.shared_weights()} == {np.dtype(np.float64)}  # the conformance marker's
    registry = strategy.discovery.registry
    for p in range(N):
        registry.claims[str(100 + p)] = PartitionClaim(p, N, sizes[p], 50)
    registry.freeze()
    strategy.discovery.nodes = {p: FakeProxy(node) for p, node in registry.holders(registry.claims).items()}
    return strategy


def flower_strategy(optimizer, initial, eta, tau, beta1, beta2):
    if optimizer == "adagrad":  # FedAdagrad takes no betas: beta_1 = beta_2 = 0
        return FedAdagrad(initial_parameters=initial, eta=eta, tau=tau)
    return FLOWER[optimizer](initial_parameters=initial, eta=eta, tau=tau, beta_1=beta1, beta_2=beta2)


def start_round(strategy, sent) -> None:
    """What configure_fit leaves behind: every partition asked, ``sent`` the parameters they train from."""
    strategy.sampled = list(range(N))
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    strategy.admission.sent_parameters = [a.copy() for a in sent]


def replies(sent, sizes, server_round, changes=None, signed=False):
    """The clients' fit replies (as tests/replies.py's ``honest_update``): ``sent`` plus each
    client's own seeded noise (``signed``: a change of SPREAD to 2 SPREAD in a direction per entry
    that all clients share, so |Delta| >= SPREAD), or plus ``changes[p]`` at the last entry of the
    last array only."""
    directions = np.random.default_rng(1000 + server_round)
    signs = [np.where(directions.random(a.shape) < 0.5, -1.0, 1.0) for a in sent] if signed else None
    results = []
    for p in ARRIVAL:
        rng = np.random.default_rng(100 * server_round + p)
        if changes is not None:
            parameters = [a.copy() for a in sent]
            parameters[-1].flat[-1] += changes[p]
        elif signed:
            parameters = [a + SPREAD * s * (1.0 + rng.random(a.shape)) for a, s in zip(sent, signs)]
        else:
            parameters = [a + SPREAD * np.sqrt(3.0) * (2.0 * rng.random(a.shape) - 1.0) for a in sent]  # std SPREAD
        metrics = {"partition-id": p, "train-loss": 1.0}
        results.append((FakeProxy(str(100 + p)), FitRes(OK, ndarrays_to_parameters(parameters), sizes[p], metrics)))
    return results


def with_sizes(results, num_examples):
    """The same replies, each with ``num_examples`` (what Flower weights by)."""
    return [(proxy, FitRes(res.status, res.parameters, num_examples, res.metrics)) for proxy, res in results]


def protofl_round(strategy, server_round, results) -> list[np.ndarray]:
    parameters, metrics = strategy.aggregate_fit(server_round, results, [])
    assert metrics["accepted"] == N, metrics
    return parameters_to_ndarrays(parameters)


def largest_difference(ours, theirs) -> tuple[float, float]:
    """(max |ours - theirs|, max |theirs|) over all arrays."""
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    return (max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs)),
            max(float(np.max(np.abs(b))) for b in theirs))


def assert_close(ours, theirs, what, extra: float = 0.0) -> float:
    """``ours`` equals Flower's ``theirs`` within rtol 1e-9 of the parameters' scale X (plus ``extra``,
    an absolute bound); returns the largest difference."""
    difference, scale = largest_difference(ours, theirs)
    bound = RTOL * scale + extra
    assert difference <= bound, f"{what}: differs from Flower's by {difference:.3g} (bound {bound:.3g})"
    return difference


def run_both(tmp_path, optimizer, form, sizes=SIZES, signed=False, full_model=False, rounds=ROUNDS, **given):
    """protofl (``form``) and Flower's strategy on the same replies, round by round: yields
    (round, protofl's new parameters, Flower's, the parameters the round started from, Flower's
    strategy)."""
    values = SETTINGS[optimizer] | given
    strategy = make_strategy(tmp_path, sizes, full_model, optimizer=optimizer, form=form, **values)
    initial = strategy.initialize_parameters(client_manager=None)  # what round 1 sends
    flower = flower_strategy(optimizer, initial, **values)
    sent = parameters_to_ndarrays(initial)
    for server_round in range(1, rounds + 1):
        start_round(strategy, sent)
        results = replies(sent, sizes, server_round, signed=signed)
        ours = protofl_round(strategy, server_round, results)
        theirs = parameters_to_ndarrays(flower.aggregate_fit(server_round, results, [])[0])
        yield server_round, ours, theirs, sent, flower
        sent = ours


@pytest.mark.parametrize("optimizer", ["adam", "yogi", "adagrad"])
def test_the_flower_form_is_flowers_strategy_round_after_round(tmp_path, optimizer):
    for server_round, ours, theirs, sent, _ in run_both(tmp_path, optimizer, "flower"):
        assert_close(ours, theirs, f"{optimizer}, round {server_round}")
        step, scale = largest_difference(ours, sent)
        assert step > 1e-3 * scale  # the server moved: a formula that differs would show


def test_the_flower_form_is_flowers_fedadam_on_the_digits_cnn(tmp_path):
    """The model protofl builds for digits (90k entries in 8 arrays; 3 rounds, the minimum for
    Adam's moments and bias correction to matter, to stay fast)."""
    for server_round, ours, theirs, sent, _ in run_both(tmp_path, "adam", "flower", full_model=True, rounds=3):
        assert_close(ours, theirs, f"adam on the digits CNN, round {server_round}")


def test_the_flower_form_adagrad_with_default_options_is_flowers_fedadagrad(tmp_path):
    defaults = {"eta": 0.01, "tau": 1e-2}  # protofl's default beta1 (0.9); FedAdagrad has no beta_1
    strategy = make_strategy(tmp_path, optimizer="adagrad", form="flower", **defaults)
    initial = strategy.initialize_parameters(client_manager=None)
    flower = FedAdagrad(initial_parameters=initial, **defaults)
    sent = parameters_to_ndarrays(initial)
    for server_round in range(1, ROUNDS + 1):
        start_round(strategy, sent)
        results = replies(sent, SIZES, server_round)
        ours = protofl_round(strategy, server_round, results)
        assert_close(ours, parameters_to_ndarrays(flower.aggregate_fit(server_round, results, [])[0]),
                     f"adagrad, default beta1, round {server_round}")
        sent = ours


def bias_correction(server_round, beta1, beta2):
    """Flower's FedAdam's factor of eta (Kingma & Ba's alpha_t, with t = server_round + 1)."""
    return math.sqrt(1 - beta2 ** (server_round + 1.0)) / (1 - beta1 ** (server_round + 1.0))


DOCUMENTED = [(optimizer, left) for optimizer in ("adam", "yogi", "adagrad")
              for left in (None, "weights", "v", "bias") if left != "bias" or optimizer == "adam"]


@pytest.mark.parametrize(("optimizer", "left"), DOCUMENTED)
def test_the_paper_form_is_flowers_with_uniform_weights_v_from_tau_squared_and_no_bias_correction(
        tmp_path, optimizer, left):
    """Flower's strategy with the three documented differences undone on its side (every reply of
    one size, its v_t started at tau^2, adam's eta divided by the round's correction) is the
    paper form (``left`` None); with one of them ``left`` as Flower has it, it is not, by far more
    than the tolerance."""
    values = SETTINGS[optimizer] | ({"beta1": 0.0} if optimizer == "adagrad" else {})  # FedAdagrad's momentum
    eta, tau, beta1, beta2 = values["eta"], values["tau"], values["beta1"], values["beta2"]
    strategy = make_strategy(tmp_path, optimizer=optimizer, form="paper", **values)
    initial = strategy.initialize_parameters(client_manager=None)
    flower = flower_strategy(optimizer, initial, **values)
    if left != "v":
        flower.v_t = [np.full_like(w, tau**2) for w in parameters_to_ndarrays(initial)]  # v_(-1) = tau^2
    difference, sent = 0.0, parameters_to_ndarrays(initial)
    for server_round in range(1, ROUNDS + 1):
        start_round(strategy, sent)
        results = replies(sent, SIZES, server_round)
        ours = protofl_round(strategy, server_round, results)
        if optimizer == "adam" and left != "bias":
            flower.eta = eta / bias_correction(server_round, beta1, beta2)  # Flower's step: plain eta
        fed = results if left == "weights" else with_sizes(results, 1)  # one size: the uniform mean
        theirs = parameters_to_ndarrays(flower.aggregate_fit(server_round, fed, [])[0])
        difference = max(difference, largest_difference(ours, theirs)[0])
        sent = ours
    scale = max(float(np.max(np.abs(a))) for a in sent)
    if left is None:
        assert difference <= RTOL * scale, f"{optimizer}: the paper form differs from undone Flower by {difference}"
    else:
        assert difference > 1e-4 * scale, f"{optimizer}: leaving Flower's {left} changed nothing ({difference})"


def test_the_paper_form_adagrad_with_equal_sizes_and_a_tiny_tau_is_flowers_fedadagrad(tmp_path):
    """Equal sizes: the uniform mean is the weighted one. tau = 1e-9 (FedAdagrad's default): v from
    tau^2 instead of 0 moves sqrt(v_t) by at most tau^2 / (2 sqrt(v_t)), a fraction tau^2 / (2 v_t)
    <= tau^2 / (2 SPREAD^2) of it (the signed replies: |Delta_t| >= SPREAD, v_t >= Delta_1^2), so the
    step eta m / (sqrt(v) + tau) (|m| / sqrt(v) <= 1 without momentum) by at most
    eta tau^2 / (2 SPREAD^2) = 5e-17 a round. The module's bound holds with sqrt(v_t) >= SPREAD in
    place of tau: A <= 1 + 2 eta / SPREAD = 3, the v shift amplified as the roundings are."""
    tau, eta = 1e-9, 0.01
    growth = (1 + 2 * eta / SPREAD) ** ROUNDS
    extra = growth * ROUNDS * eta * tau**2 / (2 * SPREAD**2)
    for server_round, ours, theirs, _, flower in run_both(tmp_path, "adagrad", "paper", sizes=EQUAL, signed=True,
                                                          eta=eta, tau=tau, beta1=0.0):
        if server_round == 1:  # FedAdagrad's v_1 = Delta_1^2: the bound's |Delta| >= SPREAD holds
            assert min(float(np.sqrt(v).min()) for v in flower.v_t) >= SPREAD * (1 - 1e-12)
        assert_close(ours, theirs, f"paper adagrad, equal sizes, tau 1e-9, round {server_round}", extra)


# A single entry by hand (the last entry of the head's bias; every other entry is sent back unchanged),
# the paper form with beta1 = 0.5, beta2 = 0.75, eta = 1, tau = 0.5 (v_(-1) = tau^2 = 0.25), over two
# rounds (and the flower form's adam below). Sizes 100, 200, 300, 400: the paper's uniform mean is
# not the sample-weighted one.
# Round 1: x_1 = 1, changes (0.5, 1.5, 1, 1): Delta_1 = 1 (weighted: 1.05); m_1 = 0.5 * 1 = 0.5.
# Round 2: changes (-0.5, 0.25, -0.25, -0.5): Delta_2 = -0.25; m_2 = 0.5 * 0.5 + 0.5 * -0.25 = 0.125.
HAND_SIZES = (100, 200, 300, 400)
HAND_CHANGES = ((0.5, 1.5, 1.0, 1.0), (-0.5, 0.25, -0.25, -0.5))
HAND = {  # (v_1, v_2): adagrad v + Delta^2; adam 0.75 v + 0.25 Delta^2; yogi v - 0.25 Delta^2 sign(v - Delta^2)
    "adagrad": (0.25 + 1.0, 1.25 + 0.0625),  # 1.25, 1.3125
    "adam": (0.75 * 0.25 + 0.25 * 1.0, 0.75 * 0.4375 + 0.25 * 0.0625),  # 0.4375, 0.34375
    "yogi": (0.25 + 0.25 * 1.0, 0.5 - 0.25 * 0.0625),  # v_0 < 1: +; v_1 = 0.5 > 0.0625: -; 0.5, 0.484375
}


def assert_by_hand(strategy, expected) -> None:
    """Two rounds of HAND_CHANGES on the last entry (from 1.0): it ends each round at ``expected``."""
    sent = parameters_to_ndarrays(strategy.initialize_parameters(client_manager=None))
    sent[-1].flat[-1] = 1.0
    for server_round, (changes, value) in enumerate(zip(HAND_CHANGES, expected), start=1):
        start_round(strategy, sent)
        ours = protofl_round(strategy, server_round, replies(sent, HAND_SIZES, server_round, changes))
        assert ours[-1].flat[-1] == pytest.approx(value, rel=FLOAT64["rtol"], abs=FLOAT64["atol"])
        others = [np.delete(a.ravel(), -1) if i == len(ours) - 1 else a.ravel() for i, a in enumerate(ours)]
        before = [np.delete(a.ravel(), -1) if i == len(sent) - 1 else a.ravel() for i, a in enumerate(sent)]
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(others, before)) <= 1e-12  # Delta = 0: no step
        sent = ours


@pytest.mark.parametrize("optimizer", sorted(HAND))
def test_the_paper_form_by_hand_on_one_entry(tmp_path, optimizer):
    v1, v2 = HAND[optimizer]
    x2 = 1.0 + 1.0 * 0.5 / (math.sqrt(v1) + 0.5)  # x + eta m_1 / (sqrt(v_1) + tau); no bias correction
    x3 = x2 + 1.0 * 0.125 / (math.sqrt(v2) + 0.5)
    if optimizer == "adagrad":
        assert x2 == pytest.approx((3 + math.sqrt(5)) / 4, rel=1e-15)  # 1 + 0.5 / (sqrt(5) / 2 + 1 / 2)
    if optimizer == "yogi":
        assert x2 == pytest.approx(math.sqrt(2), rel=1e-15)  # 1 + 0.5 / (sqrt(2) / 2 + 1 / 2)
    assert_by_hand(make_strategy(tmp_path, HAND_SIZES, optimizer=optimizer, form="paper", eta=1.0, tau=0.5,
                                 beta1=0.5, beta2=0.75), (x2, x3))


def test_the_flower_form_by_hand_on_one_entry(tmp_path):
    """FedAdam's form of the same entry: where the paper form's three differences show by hand."""
    delta1 = (100 * 0.5 + 200 * 1.5 + 300 * 1.0 + 400 * 1.0) / 1000  # 1.05: weighted by size
    delta2 = (100 * -0.5 + 200 * 0.25 + 300 * -0.25 + 400 * -0.5) / 1000  # -0.275
    m1, m2 = 0.5 * delta1, 0.5 * 0.5 * delta1 + 0.5 * delta2  # 0.525, 0.125
    v1 = 0.25 * delta1**2  # v from 0: 0.275625 = 0.525^2
    v2 = 0.75 * v1 + 0.25 * delta2**2  # 0.225625 = 0.475^2
    c1 = math.sqrt(1 - 0.75**2) / (1 - 0.5**2)  # FedAdam's bias correction, t = server_round + 1 = 2
    c2 = math.sqrt(1 - 0.75**3) / (1 - 0.5**3)  # t = 3
    x2 = 1.0 + c1 * m1 / (0.525 + 0.5)
    x3 = x2 + c2 * m2 / (0.475 + 0.5)
    assert (math.sqrt(v1), math.sqrt(v2)) == pytest.approx((0.525, 0.475), rel=1e-15)
    assert_by_hand(make_strategy(tmp_path, HAND_SIZES, optimizer="adam", form="flower", eta=1.0, tau=0.5,
                                 beta1=0.5, beta2=0.75), (x2, x3))
