"""DP prototypes (task/privacy): the clip-and-noise step, the sensitivity it really has (measured
with the real training), its accounting against numbers computed without protofl's accountant
(the RDP formula by hand, dp-accounting composed directly, Flower's own RDP accountant), releases
that a resumed run replays, and what travels in the clear."""

import dataclasses
import json
import math
import shutil

import dp_accounting
import numpy as np
import pytest
from flwr.app import RecordDict
from fakes import uploads_class_statistics
from inprocess import run_in_process

from protofl.federation.server_core import ServerCore
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, TRAIN_LOSS, ArraySpec, decode_array
from protofl.settings import ExperimentSettings
from protofl.strategies import METHODS
from protofl.strategies.fedavg import FedAvgOptions
from protofl.strategies.fedproto import FedProtoClient
from protofl.task.data import load_client_data
from protofl.task.models import build_model
from protofl.task.privacy import (
    RELEASES_FILE,
    ClearTraffic,
    ReleaseLedger,
    privatize_class_means,
    prototype_epsilon,
    release_noise_multiplier,
    release_size,
)

DELTA = 1e-5


def gaussian_epsilon(multipliers, delta=DELTA):
    """ε of Gaussian mechanisms with these noise multipliers, composed by dp-accounting directly."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in multipliers]))
    return accountant.get_epsilon(delta)


def epsilon_by_hand(multipliers, delta=DELTA):
    """The same from the formulas: a Gaussian mechanism with noise multiplier z has RDP a / (2 z^2) at
    order a; RDP adds up under composition; (a, rho)-RDP gives (rho + log(1 - 1/a) - log(delta * a) /
    (a - 1), delta)-DP (Canonne, Kamath, Steinke 2020, Prop. 12 of arXiv:2004.00010 v4), minimised
    over a dense grid of orders."""
    orders = np.linspace(1.02, 100.0, 500_000)
    rdp = orders * sum(1.0 / (2.0 * z * z) for z in multipliers)
    return float(np.min(rdp + np.log1p(-1.0 / orders) - np.log(delta * orders) / (orders - 1.0)))


# --- the mechanism and its accounting -----------------------------------------------------------


def test_rows_are_clipped_and_noised_and_absent_classes_stay_zero():
    means = np.array([[3.0, 4.0], [0.3, 0.4], [7.0, 7.0]], np.float32)
    counts = np.array([5, 2, 0])
    exact = privatize_class_means(means, counts, clip=1.0, noise=0.0, rng=np.random.default_rng(0))
    np.testing.assert_allclose(exact, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], rtol=1e-6)
    draws = np.stack([privatize_class_means(means, counts, 1.0, 2.0, np.random.default_rng(s)) for s in range(2000)])
    assert (draws[:, 2] == 0).all()
    noise = draws[:, :2] - exact[:2]
    assert noise.mean() == pytest.approx(0.0, abs=0.05) and noise.std() == pytest.approx(2.0, rel=0.05)


def test_a_release_of_k_rows_has_noise_multiplier_noise_over_2_sqrt_k():
    # std noise * clip over the sensitivity 2 * clip * sqrt(k)
    assert release_noise_multiplier(2.0, 1) == 1.0
    assert release_noise_multiplier(4.0, 4) == 1.0
    assert release_noise_multiplier(4.0, 10) == pytest.approx(0.6324555, rel=1e-6)


def test_k_is_the_most_any_evidence_shows_and_every_class_without_any():
    assert release_size(10) == 10  # no reply, no copy of the data: the most a release can hold
    assert release_size(10, counts=[np.array([3, 0, 2, 0])]) == 2
    means = np.zeros((4, 3))
    means[[0, 1, 3]] = 0.5  # a row released for a class the counts call empty
    assert release_size(10, counts=[np.array([3, 0, 2, 0]), None], means=[means]) == 3
    assert release_size(10, counts=[None], means=[None]) == 10


def test_epsilon_matches_the_rdp_formula_by_hand_and_dp_accounting_composed_directly():
    for noise, held, rounds in ((4.0, 10, 5), (2.0, 10, 5), (1.0, 3, 20), (8.0, 1, 1)):
        z = noise / (2.0 * math.sqrt(held))
        reported = prototype_epsilon(noise, [held] * rounds, DELTA)
        assert reported == pytest.approx(gaussian_epsilon([z] * rounds), rel=1e-12)
        by_hand = epsilon_by_hand([z] * rounds)
        assert by_hand <= reported + 1e-9  # dp-accounting minimises over a grid of orders
        assert reported == pytest.approx(by_hand, rel=2e-3)
    # the issue's numbers (FedProto, digits, dp-clip 1, 5 rounds, 10 classes): 22.0 at noise 4, 57.3 at noise 2
    assert round(prototype_epsilon(4.0, [10] * 5, DELTA), 1) == 22.0
    assert round(prototype_epsilon(2.0, [10] * 5, DELTA), 1) == 57.3
    # releases of different sizes compose as their own Gaussian mechanisms
    mixed = prototype_epsilon(3.0, [10, 10, 3], DELTA)
    assert mixed == pytest.approx(gaussian_epsilon([3 / (2 * math.sqrt(10))] * 2 + [3 / (2 * math.sqrt(3))]), rel=1e-12)
    assert prototype_epsilon(3.0, [3, 3, 3], DELTA) < mixed < prototype_epsilon(3.0, [10, 10, 10], DELTA)
    assert prototype_epsilon(1.0, [], DELTA) == 0.0 and prototype_epsilon(0.0, [3], DELTA) == float("inf")


def test_flowers_rdp_accountant_gives_the_same_epsilon():
    """The RdpAccountant of Flower 1.41 and 1.42 (flwr[dp]) can express the mechanism: a Gaussian release without
    amplification, composed per round. It accepts 'no-amplification' only with the add-or-remove
    relation; for a Gaussian mechanism without sampling the relation changes nothing (the
    sensitivity, of a same-class replacement here, is in the noise multiplier), as dp-accounting
    shows with either relation."""
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    for noise, held, rounds in ((4.0, 10, 5), (2.0, 7, 12)):
        z = noise / (2 * math.sqrt(held))
        config = PrivacyConfig(DELTA, 1, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
        flower = RdpAccountant(config)
        flower.compose(GaussianPrivacyEvent(z, sample_size=1, population_size=1), count=rounds)
        assert prototype_epsilon(noise, [held] * rounds, DELTA) == pytest.approx(flower.get_epsilon(DELTA), rel=1e-12)
        replace_one = dp_accounting.rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        replace_one.compose(dp_accounting.GaussianDpEvent(z), rounds)
        assert replace_one.get_epsilon(DELTA) == pytest.approx(flower.get_epsilon(DELTA), rel=1e-12)


def test_the_ledger_composes_each_partitions_releases_and_the_run_pays_for_the_worst(tmp_path):
    ledger = ReleaseLedger(path=tmp_path / RELEASES_FILE)
    assert ledger.epsilon(2.0, DELTA) is None
    ledger.record(1, {0: 10, 1: 10})  # before the replies: what the server knows
    ledger.settle(1, {0: 4})  # partition 0's reply shows 4 rows
    ledger.record(2, {1: 10, 2: 2})
    ledger.record(3, {1: 10})
    assert ledger.by_partition() == {0: [4], 1: [10, 10, 10], 2: [2]}
    assert ledger.epsilon(2.0, DELTA) == pytest.approx(gaussian_epsilon([2 / (2 * math.sqrt(10))] * 3), rel=1e-12)
    epsilons = ledger.epsilons(2.0, DELTA)
    assert epsilons[1] > epsilons[0] > epsilons[2]
    # written as it changes, read back whole
    written = [[1, 0, 4], [1, 1, 10], [2, 1, 10], [2, 2, 2], [3, 1, 10]]
    assert ReleaseLedger.load(tmp_path / RELEASES_FILE).releases == written
    assert ReleaseLedger.from_state(ledger.state(), 10).releases == written  # through a checkpoint's array
    # a replayed round: its second release is settled, the first stays
    ledger.record(3, {1: 10})
    ledger.settle(3, {1: 6})
    assert ledger.by_partition()[1] == [10, 10, 10, 6]
    # a checkpoint from before k was recorded: release counts, each taken at the number of classes
    assert ReleaseLedger.from_state({"2": 3}, 10).by_partition() == {2: [10, 10, 10]}


def test_the_keys_clients_send_are_listed_with_bounds():
    traffic = ClearTraffic()
    traffic.observe("fit", [{"train-loss": 1.0, "class-means": b""}, {"train-loss": 2.0, "x" * 65: 1}, "not a dict"])
    traffic.observe("fit", [{f"k{i}": 0 for i in range(100)}])
    assert traffic.listed("fit")[:2] == ["class-means", "k0"] and "train-loss" in traffic.listed("fit")
    assert len(traffic.listed("fit")) == ClearTraffic.MAX_KEYS and traffic.unlisted["fit"] == 1 + 100 - 62
    assert "class-means" not in traffic.listed("fit", without=["class-means"])


# --- the sensitivity, measured with the real training ---------------------------------------------


def released_rows(data, clip):
    """FedProto's first-round release of ``data`` without noise: each held class's mean feature of the
    trained model, clipped (the noise is independent of the data), and the class counts."""
    settings = ExperimentSettings(method="fedproto", local_epochs=1)
    client = FedProtoClient(settings, data, build_model("cnn", 1, 10, 16, seed=0), 4, RecordDict())
    _, _, metrics = client.fit([], {"server-round": 1, "seed": 3})
    means = decode_array(metrics[CLASS_MEANS], ArraySpec((10, 512)), 1 << 24)
    counts = decode_array(metrics[CLASS_COUNTS], ArraySpec((10,), ("int64",)), 1 << 24)
    return privatize_class_means(means, counts, clip, 0.0, np.random.default_rng(0)).astype(np.float64), counts


def test_replacing_one_sample_moves_every_row_and_stays_within_the_accounted_sensitivity():
    """Neighbouring data sets with the real training (fixed seeds, no noise): one training sample
    replaced by another of its class (a sample of the client's test split). The concatenated release
    moves by at most 2 * clip * sqrt(k), the sensitivity the accountant uses; and not only the
    swapped class's row moves (the old accounting's assumption), every held row does."""
    clip = 1.0
    data = load_client_data("digits", "", ExperimentSettings().partition_spec(4), 1)
    base, counts = released_rows(data, clip)
    k = release_size(10, counts=[counts], means=[base])
    assert k == int((counts > 0).sum()) >= 5
    sensitivity = 2 * clip * math.sqrt(k)
    train_y, test_y = data.train_y.numpy(), data.test_y.numpy()
    same = dataclasses.replace(data, train_x=data.train_x.clone())
    assert np.array_equal(released_rows(same, clip)[0], base)  # the training is deterministic: a control
    swapped_classes = [c for c in np.flatnonzero(counts) if (test_y == c).any()][:4]
    assert len(swapped_classes) >= 3
    for c in swapped_classes:
        train_x = data.train_x.clone()
        train_x[np.flatnonzero(train_y == c)[0]] = data.test_x[np.flatnonzero(test_y == c)[0]]
        moved, _ = released_rows(dataclasses.replace(data, train_x=train_x), clip)
        change = np.linalg.norm(moved - base)
        row_changes = np.linalg.norm(moved - base, axis=1)
        assert 0 < change <= sensitivity
        others = np.delete(row_changes, c)[np.delete(counts, c) > 0]
        assert (others > 1e-3).all(), f"class {c} swapped: the other rows moved by {others}"


# --- runs ---------------------------------------------------------------------------------------


def held_classes_of_partitions(num_partitions):
    """Each partition's number of held classes, from the data module (not from the server)."""
    spec = ExperimentSettings().partition_spec(num_partitions)
    return [int((load_client_data("digits", "", spec, p).class_counts() > 0).sum()) for p in range(num_partitions)]


def test_the_issues_setting_reports_the_epsilon_of_the_whole_release(tmp_path):
    """FedProto, digits, dp-noise 4, dp-clip 1, 5 rounds, every client every round: results.json's
    epsilon is the worst client's, each of its 5 releases a Gaussian mechanism of sensitivity
    2 * sqrt(10); at least the issue's 22.0 (the old accounting said 5.38)."""
    config = {"method": "fedproto", "dataset": "digits", "num-server-rounds": 5, "local-epochs": 1, "dp-noise": 4.0,
              "dp-clip": 1.0, "batch-size": 32, "eval-every": 5, "output-dir": str(tmp_path), "run-name": "dp"}
    run_in_process(config, num_nodes=4)
    results = json.loads((tmp_path / "dp" / "results.json").read_text())
    held = held_classes_of_partitions(4)
    assert max(held) == 10
    for r, record in enumerate(results["rounds"], start=1):
        expected = max(gaussian_epsilon([4.0 / (2 * math.sqrt(k))] * r) for k in held)
        assert record["dp_epsilon"] == pytest.approx(expected, rel=1e-12)
    privacy = results["privacy"]
    assert privacy["epsilon"] == results["rounds"][-1]["dp_epsilon"] >= 22.0
    assert privacy["held_classes"] == {str(p): k for p, k in enumerate(held)}
    assert privacy["releases"] == {str(p): 5 for p in range(4)} and privacy["covers"] == [CLASS_MEANS]
    assert "none claimed" in privacy["amplification"] and "OS entropy" in privacy["noise_source"]


class Crash(Exception):
    """The server process dies."""


def test_releases_after_the_checkpoint_count_again_when_a_resumed_run_replays_them(tmp_path, monkeypatch, caplog):
    """The server dies in round 3 after its clients released (checkpoint-every=2: the checkpoint is
    round 2's); the resumed run replays round 3 with fresh noise. Both round-3 releases went out, so
    each client has 5 releases, not the uninterrupted run's 4."""
    config = {"method": "fedproto", "dataset": "digits", "num-server-rounds": 4, "local-epochs": 1, "dp-noise": 4.0,
              "dp-clip": 1.0, "batch-size": 32, "checkpoint-every": 2, "output-dir": str(tmp_path),
              "run-name": "killed"}
    fit_results = ServerCore.fit_results

    def dies_in_round_3(self, server_round, results, failures):
        if server_round == 3:
            raise Crash
        return fit_results(self, server_round, results, failures)

    monkeypatch.setattr(ServerCore, "fit_results", dies_in_round_3)
    with pytest.raises(Crash):
        run_in_process(config, num_nodes=4)
    monkeypatch.undo()
    on_disk = json.loads((tmp_path / "killed" / RELEASES_FILE).read_text())["releases"]
    assert sorted({r for r, _, _ in on_disk}) == [1, 2, 3]  # round 3's releases were recorded before they went out
    # a run left by a protofl without the file: only the checkpoint's releases are known; the run says so
    shutil.copytree(tmp_path / "killed", tmp_path / "kept")
    (tmp_path / "killed" / RELEASES_FILE).unlink()
    run_in_process(config | {"resume": True}, num_nodes=4)
    assert "no dp-releases.json" in caplog.text and "those after round 2" in caplog.text
    results = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert results["privacy"]["releases"] == {str(p): 4 for p in range(4)}
    shutil.rmtree(tmp_path / "killed")
    (tmp_path / "kept").rename(tmp_path / "killed")
    run_in_process(config | {"resume": True}, num_nodes=4)
    results = json.loads((tmp_path / "killed" / "results.json").read_text())
    held = held_classes_of_partitions(4)
    releases = {p: [r for r, q, _ in json.loads((tmp_path / "killed" / RELEASES_FILE).read_text())["releases"]
                    if q == p] for p in range(4)}
    assert releases == {p: [1, 2, 3, 3, 4] for p in range(4)}
    worst = max(gaussian_epsilon([4.0 / (2 * math.sqrt(k))] * 5) for k in held)
    assert results["rounds"][-1]["dp_epsilon"] == pytest.approx(worst, rel=1e-12)
    assert results["privacy"]["releases"] == {str(p): 5 for p in range(4)}
    assert results["rounds"][-1]["dp_epsilon"] > max(gaussian_epsilon([4.0 / (2 * math.sqrt(k))] * 4) for k in held)


@pytest.mark.slow
def test_a_killed_process_resumes_counting_every_release_it_sent(tmp_path):
    """The same with SIGKILL (tests/interrupted.py), killed once round 3's training is recorded."""
    import os
    import sys

    from test_resume import TESTS, kill_during_round_3

    config = {"method": "fedproto", "dataset": "digits", "num-server-rounds": 4, "local-epochs": 1, "dp-noise": 2.0,
              "dp-clip": 1.0, "batch-size": 32, "checkpoint-every": 2, "fraction-fit": 0.5, "output-dir": str(tmp_path),
              "run-name": "killed"}
    command = [sys.executable, str(TESTS / "interrupted.py"), json.dumps(config), "4", "4"]  # hangs in round 4
    kill_during_round_3(tmp_path / "killed", command, os.environ | {"PYTHONPATH": str(TESTS)}, str(tmp_path))
    before = json.loads((tmp_path / "killed" / RELEASES_FILE).read_text())["releases"]
    run_in_process(config | {"resume": True}, num_nodes=4)
    after = json.loads((tmp_path / "killed" / RELEASES_FILE).read_text())["releases"]
    assert after[:len(before)] == before  # nothing sent before the crash is forgotten
    results = json.loads((tmp_path / "killed" / "results.json").read_text())
    sampled = {r["round"]: r["clients"] for r in results["rounds"]}
    replayed = [(r, p) for r, p, _ in after if r > 2]
    for r in (3, 4):  # rounds after the checkpoint: released before the crash (if reached) and again
        assert sum(1 for q, _ in replayed if q == r) >= len(sampled[r]) * (2 if r == 3 else 1)
    held = held_classes_of_partitions(4)
    by_partition = {p: sum(1 for _, q, _ in after if q == p) for p in range(4)}
    worst = max(gaussian_epsilon([2.0 / (2 * math.sqrt(held[p]))] * n) for p, n in by_partition.items() if n)
    assert results["privacy"]["epsilon"] == pytest.approx(worst, rel=1e-12)


def test_a_directory_with_releases_only_holds_a_run_that_resume_continues(tmp_path):
    """A run that died in round 1, before results.json or a checkpoint: its releases went out. A fresh
    run must not silently start over in its directory; resume=true starts at round 1 and keeps them;
    overwrite=true replaces the run, releases included."""
    from protofl.federation.checkpoint import open_run

    directory = tmp_path / "run"
    ReleaseLedger([(1, 0, 10)], directory / RELEASES_FILE).save()
    settings = ExperimentSettings(output_dir=str(tmp_path), run_name="run", method="fedproto", dp_noise=1.0,
                                  dp_clip=1.0)
    with pytest.raises(ValueError, match="holds a run already"):
        open_run(settings, directory)
    assert open_run(dataclasses.replace(settings, resume=True), directory) is None  # round 1 again
    assert (directory / RELEASES_FILE).is_file()
    assert open_run(dataclasses.replace(settings, overwrite=True), directory) is None
    assert not (directory / RELEASES_FILE).exists()


# --- what travels in the clear ----------------------------------------------------------------------


def test_dp_noise_is_refused_for_a_method_that_uploads_no_class_vectors(tmp_path):
    settings = ExperimentSettings(method="fedavg", dp_noise=1.0, dp_clip=1.0)
    with pytest.raises(ValueError, match="fedavg uploads none"):
        FedAvgOptions.from_settings(settings)
    with pytest.raises(ValueError, match="set dp-noise=0"):
        run_in_process({"method": "fedavg", "dp-noise": 1.0, "dp-clip": 1.0, "output-dir": str(tmp_path)}, num_nodes=2)


# fast: feature and logit statistics, and a method with its own named uploads besides; CI runs them all
@pytest.mark.parametrize("method", [m if m in ("fedproto", "fedskc", "fedsa") else
                                    pytest.param(m, marks=pytest.mark.slow)
                                    for m in METHODS if uploads_class_statistics(m)])
def test_the_privacy_block_lists_every_key_the_clients_sent(tmp_path, method):
    """Every key of every properties, fit and evaluate reply of a run is in results.json's privacy
    block: the class vectors under 'covers', everything else under 'in_the_clear'."""
    config = {"method": method, "dataset": "digits", "num-server-rounds": 2, "local-epochs": 1, "dp-noise": 1.0,
              "dp-clip": 1.0, "data-fraction": 0.3, "output-dir": str(tmp_path), "run-name": "r"}
    strategy, messages = run_in_process(config, num_nodes=3)
    privacy = json.loads((tmp_path / "r" / "results.json").read_text())["privacy"]
    clear = privacy["in_the_clear"]
    sent = {"get_properties": set(), "fit": set(), "evaluate": set()}
    for kind, _, reply in messages:
        sent[kind] |= set(getattr(reply, "properties", None) or getattr(reply, "metrics", {}))
    assert sent["fit"] and sent["evaluate"] and sent["get_properties"]
    assert sent["get_properties"] <= set(clear["properties"])
    assert sent["fit"] <= set(clear["fit"]) | set(privacy["covers"])
    assert sent["evaluate"] <= set(clear["evaluate"])
    assert {CLASS_COUNTS, TRAIN_LOSS} <= set(clear["fit"]) and CLASS_MEANS not in clear["fit"]
    assert set(strategy.loss_metrics) & sent["fit"] <= set(clear["fit"])
    assert clear["parameters"] == strategy.privacy.shared_names
    if method == "fedcosr":
        assert {"la-tau", "contrastive-loss", "ce-loss"} <= set(clear["fit"])
