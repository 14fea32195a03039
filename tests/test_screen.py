"""The magnitude screen both ways, in process: no honest client dropped for what legitimately scales
its uploads (its local steps, a class it barely holds, its control variate), and no attacker through
a bound (a class only it holds, a control variate its parameters do not make, FedPAC's feature
variance, FedAMP's attention, FedKD's rank). Four nodes hold the four partitions of digits
(tests/replies.py)."""

import io
import json
import os

from types import SimpleNamespace

import numpy as np
import pytest
from fakes import uploads_class_statistics
from flwr.common import ndarrays_to_parameters
from replies import (
    N, altered, assert_same_state, class_means_of, encode_all, honest_control_delta, honest_update, make_strategy,
    server_state,
)

from protofl.federation.screen import ScreenFindings, lower_median, screen_class_vectors
from protofl.federation.wire import CLASS_MEANS, encode_array, indexed
from protofl.strategies import METHODS
from protofl.task.train import steps_per_epoch


def round_record(tmp_path, name, server_round=1):
    return json.loads((tmp_path / name / "results.json").read_text())["rounds"][server_round - 1]


def with_class_vector(reply, class_index, scale):
    proxy, res = reply
    means = class_means_of(res)
    means[class_index] *= scale
    return proxy, altered(res, **{CLASS_MEANS: encode_array(means)})


# --- the screen's arithmetic -------------------------------------------------------------------


def test_the_lower_median_is_honest_while_fewer_than_half_are_hostile():
    assert lower_median([1.0, 9.0]) == 1.0 and lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([1.0, 1.5, 1e6, 1e6]) == 1.5  # two attackers of four


def test_a_norm_is_dropped_above_the_factor_times_its_reference_and_its_allowance():
    findings = ScreenFindings(10.0)
    findings.compare("x", "ratio", [0, 1, 2, 3], [1.0, 1.5, 2.0, 30.0])
    assert findings.reasons == {3: "x norm 30 is above 10 x the round's median 1.5"}
    assert findings.ratios == {"ratio": 20.0}
    findings = ScreenFindings(10.0)  # 30 steps where the median client took 10: three times as far
    findings.compare("x", "ratio", [0, 1, 2, 3], [1.0, 1.5, 2.0, 30.0], [1.0, 1.0, 1.0, 3.0])
    assert findings.reasons == {} and findings.ratios["ratio"] == pytest.approx(30.0 / 4.5)
    findings.compare("y", "other", [0, 1, 2], [0.0, 0.0, 5.0])  # a median of 0: nothing to compare with
    off = ScreenFindings(0.0)
    off.compare("x", "ratio", [0, 1], [1.0, 1e9])
    assert findings.reasons == off.reasons == {} and off.ratios == {"ratio": 1e9}


def test_every_class_vector_is_compared_with_the_clients_largest_norms():
    """The clients' largest held-class norms: 2, 4 and 50, their lower median 4. Class 1 of client 2
    (norm 50) is above 10 x 4, though it is that class's only holder."""
    def update(partition, norms):
        means = np.zeros((3, 2))
        means[:, 0] = norms
        statistics = SimpleNamespace(means=means, counts=(means[:, 0] > 0).astype(np.int64))
        return SimpleNamespace(partition_id=partition, statistics=statistics)

    findings = ScreenFindings(10.0)
    updates = [update(0, [1.0, 0.0, 2.0]), update(1, [2.0, 0.0, 4.0]), update(2, [1.0, 50.0, 0.0])]
    screen_class_vectors(findings, updates)
    assert findings.reasons == {2: "class 1 vector norm 50 is above 10 x the round's median 4"}
    assert findings.ratios == {"screen_prototype_ratio": pytest.approx(50 / 4)}


# --- class vectors ------------------------------------------------------------------------------

PATHOLOGICAL = {"partition": "pathological", "classes_per_client": 3}  # partition 0 alone holds class 6
SOLE = 0


@pytest.mark.parametrize("method", [m for m in METHODS if uploads_class_statistics(m)])
def test_a_vector_of_a_class_only_the_attacker_holds_is_dropped(tmp_path, method):
    """A class with one holder was never compared: its 1e21 vector reached every rule (FedProto's
    broadcast, FedGH's head; FedSKC's and FedTGP's outputs went non-finite and cancelled the round)."""
    strategy = make_strategy(method, tmp_path, "attacked", **PATHOLOGICAL)
    counts = np.stack([strategy.discovery.registry.sizes(p).train_counts for p in range(N)])
    sole = [c for c in range(10) if (counts[:, c] > 0).sum() == 1 and counts[SOLE, c] > 0]
    assert sole == [6]
    honest = [honest_update(strategy, p) for p in range(N) if p != SOLE]
    attack = with_class_vector(honest_update(strategy, SOLE), 6, 1e21)
    parameters, metrics = strategy.aggregate_fit(1, [attack] + honest, [])
    reference = make_strategy(method, tmp_path, "honest", **PATHOLOGICAL)
    reference_parameters, _ = reference.aggregate_fit(1, honest, [])
    assert metrics["accepted"] == N - 1
    assert_same_state(server_state(strategy, parameters), server_state(reference, reference_parameters))
    assert [d["partition"] for d in round_record(tmp_path, "attacked")["dropped"]] == [SOLE]


@pytest.mark.parametrize("method", ["feddistill", "fedproto"])
def test_honest_vectors_of_one_class_may_differ_many_fold_between_its_holders(tmp_path, method):
    """A class two clients barely hold has weak means there: FedDistill's mean logits of one class
    differed 32-fold between its holders on Fashion-MNIST (Dirichlet 0.1). Nobody is dropped; a
    client whose every vector is 100 times the others' still is."""
    strategy = make_strategy(method, tmp_path, "spread")
    replies = [honest_update(strategy, p) for p in range(N)]
    replies[0], replies[1] = with_class_vector(replies[0], 3, 1 / 32), with_class_vector(replies[1], 3, 1 / 32)
    _, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["accepted"] == N and round_record(tmp_path, "spread")["screen_prototype_ratio"] < 2
    proxy, res = replies[3]
    replies[3] = (proxy, altered(res, **{CLASS_MEANS: encode_array(100 * class_means_of(res))}))
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    _, metrics = strategy.aggregate_fit(2, replies, [])
    assert metrics["accepted"] == N - 1
    assert [d["partition"] for d in round_record(tmp_path, "spread", 2)["dropped"]] == [3]


# --- SCAFFOLD's control variate ---------------------------------------------------------------


def scaffold_replies(strategy, moves):
    """Fit replies whose parameters moved K eta (``moves[p]`` c + a little noise) from x, the
    server's c set beforehand to a unit-norm control, each with its honest Delta c: near 0 for a
    client whose mean corrected gradient is c, near -c for one that hardly moved."""
    s = strategy.settings
    rng = np.random.default_rng(0)
    size = sum(c.size for c in strategy.control)
    strategy.control = [(rng.normal(0, 1, c.shape) / np.sqrt(size)).astype(c.dtype) for c in strategy.control]
    replies = []
    for p, move in enumerate(moves):
        proxy, res = honest_update(strategy, p)
        steps = s.local_epochs * steps_per_epoch(res.num_examples, s.batch_size, s.partial_batch)
        controls = iter(strategy.control)
        noise = 1e-2 / np.sqrt(size)
        trained = [x - (steps * s.lr * (move * next(controls) + rng.normal(0, noise, x.shape))).astype(x.dtype)
                   if t else x for x, t in zip(strategy.admission.sent_parameters, strategy.trained_entries)]
        delta = encode_all(indexed("control-delta", honest_control_delta(strategy, trained, res.num_examples, 1)))
        replies.append((proxy, altered(res, ndarrays_to_parameters(trained), **delta)))
    return replies


def test_an_honest_control_delta_far_from_the_rounds_median_is_kept(tmp_path):
    """Delta c = (x - y) / (K eta) - c: near 0 for three clients whose mean gradient is the server's
    c, near -c, 100 times as long, for one that hardly moved: all honest."""
    strategy = make_strategy("scaffold", tmp_path, "spread")
    _, metrics = strategy.aggregate_fit(1, scaffold_replies(strategy, [1.0, 1.0, 1.0, 0.0]), [])
    assert metrics["accepted"] == N


@pytest.mark.parametrize("change", ["doubled", "another client's"])
def test_a_control_delta_its_parameters_do_not_make_is_dropped(tmp_path, change):
    """Twice the honest Delta c, or another client's, is within 10 x the round's median norm (the
    norm screen let it through), but Delta c follows from x, y, K and eta: the server checks that,
    and the round ends where the three honest updates take it."""
    moves = [0.5, 0.6, 0.4, 0.5]
    strategy = make_strategy("scaffold", tmp_path, "attacked")
    replies = scaffold_replies(strategy, moves)
    proxy, res = replies[N - 1]
    source, factor = (res, 2.0) if change == "doubled" else (replies[0][1], 1.0)
    deltas = {k: encode_array(factor * array_of(source, k)) for k in source.metrics if k.startswith("control-delta/")}
    parameters, metrics = strategy.aggregate_fit(1, replies[: N - 1] + [(proxy, altered(res, **deltas))], [])
    reference = make_strategy("scaffold", tmp_path, "honest")
    reference_parameters, _ = reference.aggregate_fit(1, scaffold_replies(reference, moves)[: N - 1], [])
    assert metrics["accepted"] == N - 1
    assert_same_state(server_state(strategy, parameters), server_state(reference, reference_parameters))
    assert "control-delta" in round_record(tmp_path, "attacked")["dropped"][0]["reason"]


def array_of(res, key):
    return np.load(io.BytesIO(res.metrics[key]))


# --- FedPAC's feature variance ------------------------------------------------------------------


def fedpac_replies(strategy, variances):
    """Replies whose heads differ, whose class centroids nearly agree and whose V_i (``variances``)
    make every client's best head a mix of the others'."""
    replies = []
    for p, variance in enumerate(variances):
        proxy, res = honest_update(strategy, p)
        rng = np.random.default_rng(p)
        heads = {k: encode_array(array_of(res, k) + rng.normal(0, 0.1, array_of(res, k).shape).astype(np.float32))
                 for k in res.metrics if k.startswith("head/")}
        centroids = array_of(res, "class-centroids")
        replies.append((proxy, altered(res, **heads, **{
            "feature-variance": encode_array(np.array([variance], np.float32)),
            "class-centroids": encode_array((np.ones_like(centroids) + 1e-3 * rng.normal(size=centroids.shape)
                                             ).astype(np.float32))})))
    return replies


def test_fedpacs_combined_heads_do_not_move_with_one_clients_huge_feature_variance(tmp_path):
    """A client's weight in another's head is at most sqrt(V_own / V_j): at V_j = 1e30 it is 0, and the
    others' heads are what they are without it. The solver's tolerance grew with the largest entry
    (1e18 here): it stopped at each client's own head."""
    strategy = make_strategy("fedpac", tmp_path, "attacked")
    strategy.aggregate_fit(1, fedpac_replies(strategy, [0.1, 0.2, 0.1, 1e30]), [])
    reference = make_strategy("fedpac", tmp_path, "honest")
    reference.aggregate_fit(1, fedpac_replies(reference, [0.1, 0.2, 0.1])[: N - 1], [])
    own = {p: [array_of(res, f"head/{i}") for i in range(len(strategy.head_initial))]
           for p, (_, res) in enumerate(fedpac_replies(reference, [0.1, 0.2, 0.1]))}
    for p in range(N - 1):
        combined, alone = strategy.combined_heads[p][1], reference.combined_heads[p][1]
        assert max(np.abs(a - b).max() for a, b in zip(combined, alone)) < 1e-4
        assert max(np.abs(a - b).max() for a, b in zip(combined, own[p])) > 0.01  # the heads are mixed


# --- FedAMP's attention -------------------------------------------------------------------------


def fedamp_models(strategy, partitions, copy_of=None, copied_from=None):
    """Replies of ``partitions`` with models far apart (squared distances in the thousands: no
    attention between them); with ``copy_of``, the last one's model is a near copy of that
    partition's (or of ``copied_from``: the initial model a first-timer holds)."""
    replies = []
    for p in partitions:
        proxy, res = honest_update(strategy, p)
        rng = np.random.default_rng(100 + p)
        models = {f"client-model/{i}": w + rng.normal(0, 0.2, w.shape).astype(w.dtype)
                  for i, w in enumerate(strategy.initial_model)}
        replies.append((proxy, res, models))
    if copy_of is not None:
        proxy, res, _ = replies[-1]
        source = copied_from if copied_from is not None else replies[copy_of][2]
        rng = np.random.default_rng(7)
        replies[-1] = (proxy, res, {k: v + rng.normal(0, 1e-3, v.shape).astype(v.dtype) for k, v in source.items()})
    return [(proxy, altered(res, **encode_all(models))) for proxy, res, models in replies]


@pytest.mark.parametrize("target", ["a peer's model", "the initial model of a first-timer"])
def test_fedamps_near_copy_cannot_take_over_a_cloud_model(tmp_path, target):
    """A near copy of client 1's model (or of the public initial model, which the server holds for a
    client it has not heard from) got attention weight ~0.94 in that client's cloud model: the
    cloud model moved towards whatever the copy added. Each peer's weight is at most 1/n (n models
    in the cloud: a peer weighs no more than in their plain mean), so the own weight stays >= 1/n."""
    strategy = make_strategy("fedamp", tmp_path, "attacked")
    initial = {f"client-model/{i}": w for i, w in enumerate(strategy.initial_model)}
    if target == "a peer's model":
        victim, replies = 1, fedamp_models(strategy, [0, 1, 2, 3], copy_of=1)
    else:  # partition 3 has not trained yet; partition 2 copies the initial model
        victim, replies = 3, fedamp_models(strategy, [0, 1, 2], copy_of=2, copied_from=initial)
    strategy.aggregate_fit(1, replies, [])
    own = strategy.client_models.get(victim, strategy.initial_model)
    attacker = strategy.client_models[len(replies) - 1]
    cloud = list(strategy.broadcast_to(2, victim).values())
    moved = np.sqrt(sum(np.sum((c.astype(np.float64) - w) ** 2) for c, w in zip(cloud, own)))
    added = np.sqrt(sum(np.sum((a.astype(np.float64) - w) ** 2) for a, w in zip(attacker, own)))
    assert moved / added <= 1 / len(strategy.client_models | {victim: own}) + 1e-6


def test_fedamps_attention_weights_are_the_papers_below_the_bound():
    from protofl.strategies.fedamp import attention_weights

    peers, own = attention_weights([10.0, 20.0], alpha_k=1.0, sigma=1.0)
    np.testing.assert_allclose(peers, [np.exp(-10.0), np.exp(-20.0)])  # xi_ij = alpha A'(d) = exp(-d / sigma) / sigma
    assert own == pytest.approx(1 - np.exp(-10.0) - np.exp(-20.0))
    peers, own = attention_weights([0.0, 0.0, 50.0], alpha_k=1.0, sigma=1.0)  # two copies: 1 each
    np.testing.assert_allclose(peers, [0.25, 0.25, np.exp(-50.0)])
    assert own == pytest.approx(0.5 - np.exp(-50.0))


# --- FedKD's rank ---------------------------------------------------------------------------------


def test_fedkd_refuses_an_upload_above_its_rounds_rank(tmp_path):
    """An honest mentee goes up compressed to the round's energy (Eq. 7-8); the same mentee
    uncompressed is not what the method sends."""
    strategy = make_strategy("fedkd", tmp_path, "attacked")
    honest = [honest_update(strategy, p) for p in range(N)]
    proxy, res = honest[N - 1]
    rng = np.random.default_rng(3)
    full_rank = [(w + rng.normal(0, 0.01, w.shape)).astype(w.dtype) if w.dtype.kind == "f" else w
                 for w in strategy.shared_weights()]
    attack = (proxy, altered(res, ndarrays_to_parameters(full_rank)))
    _, metrics = strategy.aggregate_fit(1, honest[: N - 1] + [attack], [])
    assert metrics["accepted"] == N - 1
    assert "rank" in round_record(tmp_path, "attacked")["dropped"][0]["reason"]
    strategy.admission.asked = {str(100 + p): p for p in range(N)}
    _, metrics = strategy.aggregate_fit(2, [honest_update(strategy, p, 2) for p in range(N)], [])
    assert metrics["accepted"] == N


def test_held_rank_asks_whether_some_matrix_compresses_to_the_upload():
    from protofl.strategies.fedkd import held_rank, low_rank

    # energies 9, 4, 1 (of 14): at T = 0.9 the first two ranks (13 > 12.6) are kept
    np.testing.assert_allclose(low_rank(np.diag([3.0, 2.0, 1.0]), 0.9), np.diag([3.0, 2.0, 0.0]), atol=1e-12)
    assert held_rank(np.diag([3.0, 2.0, 0.0]), 0.9) == 2  # 9 <= 0.9 x (13 + 1 x 4): some matrix makes it
    assert held_rank(np.diag([3.0, 2.0, 1.0]), 0.9) is None  # 13 > 0.9 x 14: two ranks would have done
    assert held_rank(np.diag([3.0, 0.0, 0.0]), 0.9) == 1  # one rank of over 0.9 of the energy
    # 9 <= 0.5 x (9 + 2 x 8.41): (3, 2.9, 2.5) makes it at T = 0.5 (9 <= 11.8 < 17.4)
    assert held_rank(np.diag([3.0, 2.9, 0.0]), 0.5) == 2 and held_rank(np.diag([3.0, 1.0, 0.0]), 0.5) is None
    rng = np.random.default_rng(0)
    for shape in ((20, 30), (6, 3, 5, 5)):  # a matrix; convolution kernels, one rank for all
        array = rng.normal(size=shape).astype(np.float32)
        assert held_rank(low_rank(array, 0.95), 0.95) is not None and held_rank(array, 0.95) is None


# --- whole runs ------------------------------------------------------------------------------------

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.slow
@pytest.mark.parametrize("data_fraction,round_dropped", [(0.05, 3), (0.5, 3)])
def test_scaffold_on_pfllibs_fashion_mnist_split_drops_no_honest_client(tmp_path, data_fraction, round_dropped):
    """The issue's setting (PFLlib's Dirichlet(0.1) split of Fashion-MNIST's 70,000 images over 20
    clients, all of them required every round, batch 10, lr 0.005, one epoch), on a fraction of the
    images: the screen dropped an honest client in round 3, for its parameter change (0.408 against
    the median 0.0404: it took 32 steps, the median client 3) at 5 % and for its control delta (6.28
    against 0.583) at 50 %, and the run stopped."""
    from inprocess import run_in_process

    if not os.path.isdir(FASHION_MNIST) and not os.environ.get("CI"):  # CI installs it (.ci/run)
        pytest.skip("needs Fashion-MNIST: apt-get install dataset-fashion-mnist")
    config = {"method": "scaffold", "dataset": "fmnist", "pool": "train+test", "partition": "dirichlet-pfllib",
              "alpha": 0.1, "partition-seed": 1, "test-fraction": 0.25, "data-fraction": data_fraction,
              "fraction-fit": 1.0, "min-fit-clients": 20, "batch-size": 10, "partial-batch": "drop", "lr": 0.005,
              "local-epochs": 1, "num-server-rounds": round_dropped, "global-test-pm": False,
              "output-dir": str(tmp_path), "run-name": "scaffold"}
    run_in_process(config, num_nodes=20)
    results = json.loads((tmp_path / "scaffold" / "results.json").read_text())
    assert results.get("stopped") is None and [r.get("dropped", []) for r in results["rounds"]] == [[]] * round_dropped
