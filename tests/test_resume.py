"""Checkpoints and exact resume: the checkpoint file, each node's state across rounds, the run
directory's guard, and runs that are stopped or killed and resumed, compared round by round with
runs that were not (bit-identical metrics on the CPU)."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from inprocess import SHORT_RUN_OPTIONS, methods_fast_for, run_in_process
from native import kill_trees, pids_with_argument

from protofl.federation.checkpoint import CHECKPOINT, Checkpoint, RunCheckpoints, open_run
from protofl.federation.client_state import ClientStateStore
from protofl.federation.state_disk import state_versions_kept
from protofl.federation.wire import ClassVectors, round_config
from protofl import report
from protofl.report import RunRecorder
from protofl.settings import ExperimentSettings
from protofl.strategies import METHODS
from protofl.strategies.fedproto import FedProtoOptions
from protofl.federation import checkpoint, client_state
from protofl.task import storage

TESTS = Path(__file__).resolve().parent
# batch-size 32: a third of the default's steps; what a resume must keep does not depend on it
RUN = {"dataset": "digits", "num-server-rounds": 4, "local-epochs": 1, "fraction-fit": 0.5,
       "global-test-pm-per-class": 10, "batch-size": 32, **SHORT_RUN_OPTIONS}


def rounds_without_timing(directory: Path) -> list[dict]:  # all an interrupted and an uninterrupted run share
    return report.rounds_without_timing(json.loads((directory / "results.json").read_text()))


def assert_same_rounds(resumed: Path, reference: Path) -> None:
    got, want = rounds_without_timing(resumed), rounds_without_timing(reference)
    assert [r["round"] for r in got] == [r["round"] for r in want] == list(range(1, len(want) + 1))
    for a, b in zip(got, want):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


# --- the checkpoint file ----------------------------------------------------------------------


def test_checkpoint_round_trips_every_kind_of_method_state(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "fields": {
            "anchors": rng.standard_normal((10, 4)).astype(np.float32),
            "global_prototypes": ClassVectors(rng.standard_normal((10, 4)).astype(np.float32), np.arange(10) < 7),
            "knowledge": {"relational-labels": np.array([3, 1], np.int64)},  # FedSC's dict of arrays
            "global_weights": [np.ones((2, 2), np.float64), np.array(5, np.int64)],  # FedSKC's list
            "nothing_yet": None,
            "applied": {0: 1, 3: 2},  # SCAFFOLD's partition -> round, integer keys
        },
        "num_partitions": 4,
        "releases": {"2": 3},
    }
    checkpoint = Checkpoint(7, [np.zeros(3, np.float32)], state, {"rounds": [{"round": 7}]}, "ab12")
    size = checkpoint.save(tmp_path)
    assert size == (tmp_path / CHECKPOINT).stat().st_size
    loaded = Checkpoint.load(tmp_path)
    assert (loaded.server_round, loaded.run_token, loaded.results) == (7, "ab12", {"rounds": [{"round": 7}]})
    fields = loaded.strategy_state["fields"]
    np.testing.assert_array_equal(fields["anchors"], state["fields"]["anchors"])
    assert fields["anchors"].dtype == np.float32
    assert isinstance(fields["global_prototypes"], ClassVectors)
    np.testing.assert_array_equal(fields["global_prototypes"].mask, np.arange(10) < 7)
    assert fields["knowledge"]["relational-labels"].tolist() == [3, 1]
    assert [w.dtype for w in fields["global_weights"]] == [np.float64, np.int64]
    assert fields["nothing_yet"] is None and loaded.strategy_state["releases"] == {"2": 3}
    assert fields["applied"] == {0: 1, 3: 2} and all(isinstance(k, int) for k in fields["applied"])
    with pytest.raises(TypeError):  # what it cannot write back exactly, it refuses to write
        Checkpoint(1, [], {"fields": {"x": object()}}, {}, "").to_bytes()


def test_an_interrupted_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    Checkpoint(1, [np.ones(2)], {}, {}, "aa").save(tmp_path)

    def crash(*args):
        raise OSError("power cut")

    monkeypatch.setattr(storage.os, "replace", crash)
    with pytest.raises(OSError):
        Checkpoint(2, [np.ones(2)], {}, {}, "aa").save(tmp_path)
    assert Checkpoint.load(tmp_path).server_round == 1
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no partial file left behind


# --- what a node keeps for its partition ------------------------------------------------------


def test_checkpoints_are_due_every_few_rounds_and_after_the_last(tmp_path):
    settings = ExperimentSettings(checkpoint_every=2, num_server_rounds=5, output_dir=str(tmp_path), run_name="r")
    recorder = RunRecorder(settings.run_directory(), settings.as_dict())
    checkpoints = RunCheckpoints(settings, recorder)
    saved = []
    for server_round in range(1, 6):
        recorder.update(server_round, train_loss=1.0)
        checkpoints.save(server_round, [np.zeros(2)], lambda: saved.append(server_round) or {})
        assert checkpoints.run_identity(server_round + 1)[:3] == ("r", checkpoints.run_token, saved[-1] if saved else 0)
    assert saved == [2, 4, 5] and Checkpoint.load(settings.run_directory()).server_round == 5
    assert recorder.rounds[4]["checkpoint_bytes"] > 0 and "checkpoint_bytes" not in recorder.rounds[3]
    without = RunCheckpoints(ExperimentSettings(checkpoint_every=0), recorder)  # every earlier round counts as kept
    assert without.run_identity(4)[2] == 3


def test_a_resume_checks_each_partition_that_trained_once_against_its_last_training(tmp_path):
    settings = ExperimentSettings(checkpoint_every=2, num_server_rounds=6, output_dir=str(tmp_path), run_name="r")
    recorder = RunRecorder(settings.run_directory(), settings.as_dict())
    before = RunCheckpoints(settings, recorder)
    before.trained(1, [0, 1, 2])
    before.trained(2, [0, 1])  # partition 2 did not reply in round 2
    checkpoint = Checkpoint(2, [np.zeros(1)], {}, {"rounds": [], "started": "then"}, "ab")
    resumed = RunCheckpoints(settings, recorder, "/run/client-state")
    resumed.restore(checkpoint, before.state(), keeps_client_state=True)
    # 0: state of its last training; 1: an older one; 2: round 1's, its last; 3: never trained
    assert resumed.lost_state({0: 2, 1: 1, 2: 1, 3: 0}) == [1]
    assert resumed.lost_state({1: 0, 4: None}) == []  # each partition is checked once
    resumed.restore(checkpoint, before.state(), keeps_client_state=True)
    problem = resumed.check_client_state({0: None, 1: 2, 2: 0})
    assert "partitions 0, 2 trained before round 3" in problem and "/run/client-state" in problem
    resumed.restore(checkpoint, before.state(), keeps_client_state=False)  # nothing kept: nothing to lose
    assert resumed.check_client_state({0: None, 1: 0, 2: 0}) is None
    old = RunCheckpoints(settings, recorder)  # a checkpoint from before last_trained: the sampled clients
    sampled = {"rounds": [{"round": 1, "clients": [0, 3]}, {"round": 2, "clients": [3]}], "started": "then"}
    old.restore(dataclasses.replace(checkpoint, results=sampled), None, keeps_client_state=True)
    assert old.lost_state({0: 1, 3: 1}) == [3]


def test_a_replayed_round_reads_the_state_from_before_it_and_old_versions_go(tmp_path):
    store = ClientStateStore(RecordDict(), 3, str(tmp_path))
    for r in (1, 2, 3):  # the server checkpointed round 1 (checkpoint-every=2, say)
        store.save("run", "ab", r, {"w": np.full(2, float(r))}, needed_from=1)
    folder = tmp_path / "run" / "partition-3"
    assert sorted(p.name for p in folder.iterdir()) == [f"round-{r}.ab.state" for r in (1, 2, 3)]
    assert store.load("run", "ab", before=3)["w"][0] == 2.0  # round 3 again: from round 2's state
    assert store.load("run", "ab", before=2)["w"][0] == 1.0
    assert store.load("run", "ab", before=1) == {}  # before its first round: nothing
    assert store.load("run", "ab", before=None)["w"][0] == 3.0
    assert store.load("run", "cd", before=None) == {}  # another run's token: not this run's state
    (folder / ".round-4.ab.state.x.tmp").write_bytes(b"partial")
    store.save("run", "ab", 4, {"w": np.full(2, 4.0)}, needed_from=3)  # checkpoint at 3: 1 and 2 go
    assert sorted(p.name for p in folder.iterdir()) == ["round-3.ab.state", "round-4.ab.state"]
    store.save("run", "ef", 1, {"w": np.zeros(2)}, needed_from=0)  # a fresh run replaces the old one's
    assert sorted(p.name for p in folder.iterdir()) == ["round-1.ef.state"]
    assert os.stat(folder / "round-1.ef.state").st_mode & 0o777 == 0o600


def test_state_files_are_array_blobs_and_earlier_npz_versions_are_still_read(tmp_path):
    """A state file is an array blob (no zip, no CRC: written and read every round); one that an
    earlier protofl wrote as .npz is still read, and a newer blob of the same round wins."""
    store = ClientStateStore(RecordDict(), 0, str(tmp_path))
    folder = tmp_path / "run" / "partition-0"
    folder.mkdir(parents=True)
    (folder / "round-1.ab.npz").write_bytes(storage.arrays_to_bytes({"w": np.full(2, 1.0)}))
    assert store.load("run", "ab", before=2)["w"].tolist() == [1.0, 1.0]
    store.save("run", "ab", 2, {"w": np.full(2, 2.0), "n": np.int64(7)}, needed_from=1)
    assert (folder / "round-2.ab.state").read_bytes().startswith(storage.BLOB_MAGIC)
    loaded = store.load("run", "ab", before=3)
    assert loaded["w"].tolist() == [2.0, 2.0] and loaded["n"] == 7 and loaded["w"].flags.writeable
    (folder / "round-1.ab.state").write_bytes(storage.arrays_to_blob({"w": np.full(2, 5.0)}))
    assert store.load("run", "ab", before=2)["w"].tolist() == [5.0, 5.0]


def test_a_damaged_array_blob_is_a_value_error():
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(5), "e": np.zeros((0, 4))}
    blob = storage.arrays_to_blob(arrays)
    back = storage.arrays_from_blob(bytearray(blob))
    assert {k: (v.dtype, v.shape) for k, v in back.items()} == {k: (v.dtype, v.shape) for k, v in arrays.items()}
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())
    damaged = [b"PK" + blob[2:], blob[:40], blob[:-4], blob.replace(b'"<f4"', b'"|O"'), blob.replace(b'"<f4"', b'"zz"'),
               blob.replace(b"[2, 3]", b"[2, -3]"), blob.replace(b'"w"', b'"n"')]
    for data in damaged:
        with pytest.raises(ValueError):
            storage.arrays_from_blob(data)
    with pytest.raises(ValueError, match="object"):
        storage.arrays_to_blob({"o": np.array([None])})


def test_a_fit_that_first_scores_the_previous_round_reads_the_state_once(tmp_path, monkeypatch):
    """evaluation-message=fit scores the state from before this round, then trains from the same
    state: one read, not two (tv-resnet18's state is 43 MB)."""
    store = ClientStateStore(RecordDict(), 0, str(tmp_path))
    store.save("run", "ab", 1, {"w": np.full(2, 1.0)}, needed_from=0)
    reads = []
    monkeypatch.setattr(client_state, "read_file", lambda path: reads.append(path) or storage.read_file(path))
    state = client_state.LocalState(store)
    config = round_config(2, 0, "run", "ab")
    for _ in range(2):
        state.use(config, 2)
        assert state.arrays["w"].tolist() == [1.0, 1.0]
    state.use(config, 3)
    assert state.arrays["w"].tolist() == [1.0, 1.0]
    assert len(reads) == 2


def test_state_dir_memory_keeps_one_version_in_context_state():
    state = RecordDict()
    store = ClientStateStore(state, 0, "memory")
    store.save("run", "ab", 1, {"w": np.ones(2)}, needed_from=0)
    store.save("run", "ab", 2, {"w": np.full(2, 2.0)}, needed_from=1)
    assert list(state) == ["protofl-state"] and store.load("run", "ab", before=None)["w"][0] == 2.0
    assert store.newest_round("run", "ab", before=3) == 2 and store.load("run", "ab", before=2) == {}


def test_the_default_state_dir_is_the_servers_in_simulation_else_the_flower_home(tmp_path, monkeypatch):
    """Without a state-dir, a node keeps its state where the server's instruction says (simulation:
    the run directory's client-state), else under its Flower home, in a directory only its user
    can enter; a node's or the run's state-dir wins over both."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    config = round_config(1, 0, "run", "ab", 0)
    store = ClientStateStore(RecordDict(), 2)
    store.locate(config)
    store.save("run", "ab", 1, {"w": np.ones(2)}, needed_from=0)
    default = tmp_path / "home" / "protofl-state"
    assert (default / "run" / "partition-2" / "round-1.ab.state").is_file()
    assert os.stat(default).st_mode & 0o777 == 0o700
    store.locate(round_config(2, 0, "run", "ab", 1, str(tmp_path / "run-dir" / "client-state")))
    assert store.newest_round("run", "ab", before=None) == 0  # another directory: nothing there yet
    store.save("run", "ab", 2, {"w": np.ones(2)}, needed_from=1)
    assert (tmp_path / "run-dir" / "client-state" / "run" / "partition-2" / "round-2.ab.state").is_file()
    chosen = ClientStateStore(RecordDict(), 2, str(tmp_path / "mine"))
    chosen.locate(round_config(2, 0, "run", "ab", 1, str(tmp_path / "run-dir" / "client-state")))
    assert chosen.directory == tmp_path / "mine"


@pytest.mark.parametrize("every", [0, 1, 3])
def test_a_partition_never_holds_more_state_files_than_the_disk_check_counts(tmp_path, monkeypatch, every):
    """state_versions_kept(checkpoint-every) against the store itself, over 12 rounds of saves as
    the server's instructions ask for them (the last checkpoint before each round)."""
    store, most, write = ClientStateStore(RecordDict(), 0, str(tmp_path)), [0], client_state.atomic_write

    def counting(path, data, **kwargs):  # a new version beside the older ones, before those go
        write(path, data, **kwargs)
        most[0] = max(most[0], len(list(path.parent.glob("*.state"))))

    monkeypatch.setattr(client_state, "atomic_write", counting)
    for r in range(1, 13):
        store.save("run", "ab", r, {"w": np.zeros(2)}, needed_from=(r - 1) // every * every if every else r - 1)
    assert most == [state_versions_kept(every)]


def test_a_run_whose_client_state_would_not_fit_its_disk_stops_before_round_1(tmp_path, monkeypatch, caplog):
    """FedProto keeps each client's model (digits' cnn: 362,024 bytes) for 3 partitions, 3 versions
    each at checkpoint-every=1: 3.1 MiB. With 2 MiB free the run stops before any client trains;
    with 5 MiB it runs, with a warning (more than half the free space)."""
    run_config = {"method": "fedproto", "num-server-rounds": 1, "local-epochs": 1, "output-dir": str(tmp_path)}

    def free(mib):
        return lambda path: shutil._ntuple_diskusage(10**12, 10**12 - mib * 2**20, mib * 2**20)

    monkeypatch.setattr(shutil, "disk_usage", free(2))
    _, messages = run_in_process(run_config | {"run-name": "small"})
    stopped = json.loads((tmp_path / "small" / "results.json").read_text())["stopped"]
    assert stopped.startswith("the clients' state needs up to 3.1 MiB (3 partitions x 0.3 MiB x 3 versions kept, "
                              f"checkpoint-every=1) in {tmp_path / 'small' / 'client-state'}, whose disk has 2.0 MiB free: "
                              "free space there, set state-dir")
    assert "fit" not in [kind for kind, _, _ in messages]
    monkeypatch.setattr(shutil, "disk_usage", free(5))
    run_in_process(run_config | {"run-name": "enough"})
    assert "stopped" not in json.loads((tmp_path / "enough" / "results.json").read_text())
    assert any("whose disk has 5.0 MiB free" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_a_client_keeps_state_only_where_it_sees_the_servers_marker(tmp_path):
    """In simulation the server marks the clients' state dir with its run; a client that keeps its
    state there but does not see the mark (another node's disk at the same path) neither reads nor
    writes state. A client with a state dir of its own, and one in a deployment (nothing marked),
    is not checked; nor does a deployment's server read anything into failure texts."""
    settings = ExperimentSettings(output_dir=str(tmp_path), run_name="r")
    recorder = RunRecorder(settings.run_directory(), settings.as_dict())
    shared = tmp_path / "r" / "client-state"
    checkpoints = RunCheckpoints(settings, recorder, str(shared))
    config = checkpoints.round_config(1, 0)
    marker = client_state.run_marker(shared, "r", checkpoints.run_token)
    assert marker.is_file() and os.stat(shared).st_mode & 0o777 == 0o700

    def client(state_dir=""):
        state = client_state.LocalState(ClientStateStore(RecordDict(), 0, state_dir))
        state.use(config, 1)
        return state

    state = client()
    state.arrays["w"] = np.ones(2)
    state.save(config)
    assert (shared / "r" / "partition-0" / f"round-1.{checkpoints.run_token}.state").is_file()
    marker.unlink()  # this node does not see the server's disk
    with pytest.raises(client_state.StateDirNotShared, match=f"state-dir {shared} is not shared with the ServerApp"):
        client().arrays
    with pytest.raises(client_state.StateDirNotShared):
        state.save(config)
    assert client(str(tmp_path / "own")).arrays == {}

    failure = f"<class 'ClientAppException'>:<'\nException ClientAppException occurred. Message: {state_dir_refusal(client)}'>"
    assert checkpoints.unshared_state(["other", failure]).startswith(f"state-dir {shared} is not shared")
    assert "\n" not in checkpoints.unshared_state([failure]) and "'" not in checkpoints.unshared_state([failure])
    deployment = RunCheckpoints(settings, recorder)
    assert deployment.round_config(1, 0).keys() == round_config(1, 0).keys()
    assert deployment.unshared_state([failure]) is None


def state_dir_refusal(client):
    try:
        client().arrays
    except client_state.StateDirNotShared as refusal:
        return str(refusal)
    raise AssertionError("not refused")


@pytest.mark.parametrize("method", ["fedproto", "fedavg"])
def test_a_simulated_node_that_does_not_see_the_state_dir_stops_a_run_that_keeps_state(tmp_path, monkeypatch, method):
    """The server's mark gone before each round's instructions (every client on another disk): a
    method whose clients keep state stops in round 1 with the client's one line and nothing
    trained; FedAvg, which keeps none, runs."""
    placing = RunCheckpoints.round_config

    def placed_where_no_client_sees(self, *args):
        config = placing(self, *args)
        client_state.run_marker(Path(self.marked_state_dir), self.recorder.directory.name, self.run_token).unlink()
        self.marker_placed = ""
        return config

    monkeypatch.setattr(RunCheckpoints, "round_config", placed_where_no_client_sees)
    run_in_process({"method": method, "num-server-rounds": 1, "output-dir": str(tmp_path), "run-name": "r"})
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    if method == "fedavg":
        assert "stopped" not in results and len(results["rounds"]) == 1
        return
    assert re.fullmatch(rf"round 1: state-dir {tmp_path / 'r' / 'client-state'} is not shared with the ServerApp: "
                        r"the ClientApp on \S+ does not see the marker [^\n]*", results["stopped"])
    assert [r["train_loss"] for r in results["rounds"]] == [None]


# --- starting a run: fresh, resumed, refused ----------------------------------------------------


def settings(tmp_path, **overrides):
    return ExperimentSettings(output_dir=str(tmp_path), run_name="run", **overrides)


def test_a_run_directory_is_never_overwritten_silently(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="resume=true continues it, overwrite=true replaces it"):
        open_run(settings(tmp_path), directory)
    with pytest.raises(ValueError, match="has results but no checkpoint"):
        open_run(settings(tmp_path, resume=True), directory)
    Checkpoint(2, [], {}, {"run_config": settings(tmp_path).as_dict()}, "aa").save(directory)
    assert open_run(settings(tmp_path, overwrite=True), directory) is None
    assert not (directory / CHECKPOINT).exists()  # a replaced run cannot be resumed by mistake
    with pytest.raises(ValueError, match="set run-name"):
        ExperimentSettings.from_run_config({"resume": True})
    assert open_run(settings(tmp_path, resume=True), tmp_path / "new") is None  # nothing yet: round 1


def test_resume_names_the_settings_that_differ_and_allows_extending_the_run(tmp_path):
    saved = settings(tmp_path, num_server_rounds=4, options={"lambda": 1.0}, method="fedproto")
    Checkpoint(4, [], {}, {"run_config": saved.as_dict()}, "aa").save(tmp_path / "run")
    changed = settings(tmp_path, resume=True, num_server_rounds=6, lr=0.1, method="fedproto",
                       options={"lambda": 2.0}, checkpoint_every=5)
    with pytest.raises(ValueError) as err:
        open_run(changed, tmp_path / "run")
    assert "fedproto.lambda (1.0 -> 2.0), lr (0.05 -> 0.1)" in str(err.value)
    assert "num-server-rounds" not in str(err.value).split(";")[0]
    with pytest.raises(ValueError, match="is complete"):
        open_run(settings(tmp_path, resume=True, num_server_rounds=4, method="fedproto", options={"lambda": 1.0}),
                 tmp_path / "run")
    extended = settings(tmp_path, resume=True, num_server_rounds=6, method="fedproto", options={"lambda": 1.0})
    assert open_run(extended, tmp_path / "run").server_round == 4


def test_a_key_an_older_checkpoint_lacks_resumes_at_its_default(tmp_path):
    older = settings(tmp_path, num_server_rounds=4, options={"lambda": 1.0}, method="fedproto").as_dict()
    del older["screen_factor"]  # run-config keys that did not exist when it was written
    Checkpoint(2, [], {}, {"run_config": older}, "aa").save(tmp_path / "run")
    defaults = FedProtoOptions.run_config_defaults()
    today = settings(tmp_path, resume=True, num_server_rounds=4, method="fedproto",
                     options={"lambda": 1.0, "weighting": "count", "inference": "prototype"})
    assert open_run(today, tmp_path / "run", defaults).server_round == 2
    for changed, named in (({"screen_factor": 5.0}, "screen-factor (10.0 -> 5.0)"),
                           ({"options": {"lambda": 1.0, "weighting": "uniform"}}, "fedproto.weighting")):
        with pytest.raises(ValueError, match=re.escape(named)):
            open_run(dataclasses.replace(today, **changed), tmp_path / "run", defaults)


# --- runs stopped and resumed -------------------------------------------------------------------


# fast: FedSA (personal models, margins, anchors); CI runs every method
@pytest.mark.parametrize("method", methods_fast_for("fedsa"))
def test_a_run_extended_after_round_2_equals_a_run_of_4_rounds(tmp_path, method):
    config = RUN | {"method": method, "output-dir": str(tmp_path), "state-dir": str(tmp_path / "state")}
    run_in_process(config | {"run-name": "whole"}, num_nodes=4)
    run_in_process(config | {"run-name": "parts", "num-server-rounds": 2}, num_nodes=4)
    assert Checkpoint.load(tmp_path / "parts").server_round == 2
    run_in_process(config | {"run-name": "parts", "resume": True}, num_nodes=4)  # new nodes: a restarted node
    assert_same_rounds(tmp_path / "parts", tmp_path / "whole")
    assert json.loads((tmp_path / "parts" / "results.json").read_text())["resumed_after"] == [2]


def test_without_a_state_dir_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """No state-dir set: the nodes keep their personal models in the run directory, where restarted
    nodes find them again."""
    config = RUN | {"method": "fedproto", "output-dir": str(tmp_path), "fraction-fit": 1.0}
    run_in_process(config | {"run-name": "whole"}, num_nodes=4)
    run_in_process(config | {"run-name": "parts", "num-server-rounds": 2}, num_nodes=4)
    assert sorted(p.name for p in (tmp_path / "parts" / "client-state" / "parts").glob("partition-*")) == [
        f"partition-{p}" for p in range(4)]
    run_in_process(config | {"run-name": "parts", "resume": True}, num_nodes=4)
    assert_same_rounds(tmp_path / "parts", tmp_path / "whole")


@pytest.mark.parametrize("lose", ["memory", "deleted"])
def test_a_resume_whose_nodes_lost_their_state_stops_before_its_first_round(tmp_path, lose):
    """Restarted nodes without their personal models (kept in memory, or the state deleted) would
    give other numbers than the uninterrupted run: the resumed run stops before its first round,
    naming the partitions; resume-fresh-clients=true goes on with fresh models, and says so."""
    config = RUN | {"method": "fedproto", "output-dir": str(tmp_path), "fraction-fit": 1.0, "run-name": "parts"}
    config |= {"state-dir": "memory"} if lose == "memory" else {}
    run_in_process(config | {"num-server-rounds": 2}, num_nodes=4)
    if lose == "deleted":
        shutil.rmtree(tmp_path / "parts" / "client-state")
    run_in_process(config | {"resume": True}, num_nodes=4)
    results = json.loads((tmp_path / "parts" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2] and Checkpoint.load(tmp_path / "parts").server_round == 2
    assert "partitions 0, 1, 2, 3 trained before round 3" in results["stopped"]
    assert "resume-fresh-clients=true" in results["stopped"]
    where = "state-dir='memory'" if lose == "memory" else str(tmp_path / "parts" / "client-state")
    assert where in results["stopped"]
    run_in_process(config | {"resume": True, "resume-fresh-clients": True}, num_nodes=4)
    results = json.loads((tmp_path / "parts" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3, 4] and "stopped" not in results
    assert results["fresh_clients"] == [{"after_round": 2, "partitions": [0, 1, 2, 3]}]


# fast: a method that keeps nothing, a personal model, a model and more (FedSA's margin, Ditto's
# second model), a model kept only to score; CI runs them all
FAST_DECLARATIONS = {"fedavg", "fedproto", "fedsa", "ditto"}


@pytest.mark.parametrize("method, options", [
    *((m, {}) if m in FAST_DECLARATIONS else pytest.param(m, {}, marks=pytest.mark.slow) for m in sorted(METHODS)),
    ("fedavg", {"fedavg.personal-model": "local"}), ("fedproto", {"fedproto.average-parameters": True}),
])
def test_a_method_declares_the_client_state_it_keeps(tmp_path, method, options):
    """What a resume checks (MethodOptions.keeps_client_state) is what the clients really keep."""
    config = RUN | {"method": method, "output-dir": str(tmp_path), "run-name": "r", "num-server-rounds": 1} | options
    strategy, _ = run_in_process(config, num_nodes=3)
    kept = list((tmp_path / "r" / "client-state").glob("r/partition-*/round-1.*.state"))
    assert bool(kept) == strategy.options.keeps_client_state


def test_methods_without_client_state_resume_without_any(tmp_path):
    """FedAvg keeps nothing on the nodes: a resume needs no state, and none is written."""
    config = RUN | {"method": "fedavg", "output-dir": str(tmp_path), "fraction-fit": 1.0, "run-name": "parts"}
    run_in_process(config | {"num-server-rounds": 2, "state-dir": "memory"}, num_nodes=4)
    run_in_process(config | {"resume": True, "state-dir": "memory"}, num_nodes=4)
    assert "stopped" not in json.loads((tmp_path / "parts" / "results.json").read_text())


def wait_for_round(directory: Path, server_round: int, process: subprocess.Popen | None, timeout: float) -> None:
    """Until results.json records ``server_round``'s training (bounded; ``process``: the run's, if
    it must not end first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(r["round"] == server_round for r in json.loads((directory / "results.json").read_text())["rounds"]):
                return
        except (OSError, ValueError, KeyError):
            pass
        assert process is None or process.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.01)
    raise AssertionError(f"no round {server_round} after {timeout} s")


def kill_during_round_3(directory: Path, command: list[str], env: dict[str, str], marker: str,
                        attempts: int = 1) -> None:
    """Start ``command``, SIGKILL its whole process tree once round 3's training is recorded (with
    checkpoint-every=2: the last checkpoint is round 2's, and the nodes saved their round-3 state).
    An in-process run (tests/interrupted.py) hangs in round 4's fit until killed; a run that cannot
    be held (`flwr run`) may pass round 4's checkpoint before a loaded machine schedules the kill:
    such a kill proves nothing, and the run is started again from scratch, up to ``attempts`` times."""
    for _ in range(attempts):
        shutil.rmtree(directory, ignore_errors=True)
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            wait_for_round(directory, 3, process, timeout=300)
        finally:
            kill_trees([process.pid, *pids_with_argument(marker)], signals=(signal.SIGKILL,))
            process.wait(timeout=30)
        if Checkpoint.load(directory).server_round == 2:
            return
    raise AssertionError(f"killed too late {attempts} times: round 4's checkpoint was written")


@pytest.mark.slow
@pytest.mark.parametrize("method, fraction, fronts", [
    ("fedavg", 0.5, ("message", "message")), ("fedproto", 1.0, ("legacy", "message")),
    ("fedskc", 0.5, ("message", "message")), ("fedsa", 1.0, ("message", "legacy")),
    ("fedcosr", 0.5, ("message", "message"))])
def test_a_process_killed_in_round_3_resumes_to_the_uninterrupted_results(tmp_path, method, fraction, fronts):
    """With every client in every round (fraction 1), round 2's scores were still to come in round
    3's fit message when the process died: the checkpoint must remember to ask for them. ``fronts``:
    the Flower fronts of the killed run and of its resume (a run may resume on the other front); the
    uninterrupted run's is the Message API."""
    config = RUN | {"method": method, "output-dir": str(tmp_path), "state-dir": str(tmp_path / "state"),
                    "checkpoint-every": 2, "fraction-fit": fraction}
    run_in_process(config | {"run-name": "whole"}, num_nodes=4)
    killed = config | {"run-name": "killed", "flower-api": fronts[0]}
    command = [sys.executable, str(TESTS / "interrupted.py"), json.dumps(killed), "4", "4"]  # hangs in round 4
    kill_during_round_3(tmp_path / "killed", command, os.environ | {"PYTHONPATH": str(TESTS)}, str(tmp_path))
    saved = sorted(p.name for p in (tmp_path / "state" / "killed").glob("partition-*/round-3.*.state"))
    assert saved or method in ("fedavg", "fedskc")  # personal models of round 3, which the replay must not read
    run_in_process(killed | {"resume": True, "flower-api": fronts[1]}, num_nodes=4)
    assert_same_rounds(tmp_path / "killed", tmp_path / "whole")


@pytest.mark.slow
# FedSA: a personal model, its margin, and float sums on the server that depend on the thread
# count; the other methods are killed in process above (a `flwr run` kill costs about a minute of CI)
@pytest.mark.parametrize("method", ["fedsa"])
def test_flwr_run_killed_in_round_3_resumes_to_the_uninterrupted_results(tmp_path, method):
    """The same through `flwr run` (Ray simulation), with no state-dir anywhere: the managed
    SuperLink, the simulation and its Ray workers are all killed, then `flwr run ... resume=true`
    finishes the run. The uninterrupted run is the in-process one, its clients on threads: the
    numbers of clients in Ray's worker processes must be theirs (every process with one torch
    thread: the server's own float sums, e.g. FedSA's margins, depend on the thread count)."""
    from test_flwr_run import flwr_command, flwr_run

    config = (f"method='{method}' num-server-rounds=4 local-epochs=1 fraction-fit=0.67 checkpoint-every=2 "
              "global-test-pm-per-class=10 batch-size=32")  # RUN's
    command, env = flwr_command(tmp_path, config, "killed")
    kill_during_round_3(tmp_path / "killed", command, env | {"OMP_NUM_THREADS": "1"}, env["FLWR_HOME"], attempts=3)
    resumed = flwr_run(tmp_path, config + " resume=true", "killed", {"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    assert f"results written to {tmp_path / 'killed'}" in resumed.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker (client-resources-num-cpus=1)
    try:
        run_in_process(RUN | {"method": method, "output-dir": str(tmp_path), "run-name": "whole",
                              "fraction-fit": 0.67, "checkpoint-every": 2}, num_nodes=3)
    finally:
        torch.set_num_threads(threads)
    assert_same_rounds(tmp_path / "killed", tmp_path / "whole")
