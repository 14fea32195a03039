"""The host work around a client message: client state kept in the process instead of read again,
its fsync off the reply's path where the server syncs it before its checkpoint, and the kept
model's reset on the model's device."""

import os

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from inprocess import run_in_process

from protofl.federation import checkpoint, client_state
from protofl.federation.client_state import ClientStateStore, LocalState
from protofl.federation.wire import round_config
from protofl.task import kept_models, storage

BIG = 2**30


@pytest.fixture(autouse=True)
def kept_states(monkeypatch):
    """This test's process cache, empty and its own."""
    monkeypatch.setattr(client_state, "KEPT_STATES", client_state.KeptStates())
    return client_state.KEPT_STATES


@pytest.fixture
def reads(monkeypatch):
    """The state files read (not taken from the process)."""
    done = []
    monkeypatch.setattr(client_state, "read_file", lambda path: done.append(path.name) or storage.read_file(path))
    return done


def test_a_process_takes_the_state_it_saved_or_read_from_memory_while_that_file_is_the_newest(tmp_path, reads):
    mine = ClientStateStore(RecordDict(), 0, str(tmp_path), BIG)
    mine.save("run", "ab", 1, {"w": np.full(3, 1.0)}, needed_from=0)
    assert mine.load("run", "ab", 2)["w"].tolist() == [1.0] * 3 and reads == []

    other = ClientStateStore(RecordDict(), 0, str(tmp_path), 0)  # another process trains round 2
    other.save("run", "ab", 2, {"w": np.full(3, 2.0)}, needed_from=1)
    assert mine.load("run", "ab", 3)["w"].tolist() == [2.0] * 3 and reads == ["round-2.ab.state"]
    assert mine.load("run", "ab", 3)["w"].tolist() == [2.0] * 3 and len(reads) == 1  # kept when read

    other.save("run", "ab", 2, {"w": np.full(3, 5.0)}, needed_from=1)  # round 2 trained again (a replay)
    assert mine.load("run", "ab", 3)["w"].tolist() == [5.0] * 3 and len(reads) == 2
    assert mine.load("run", "ab", 2)["w"].tolist() == [1.0] * 3 and len(reads) == 3  # an older version: the file


def test_what_a_message_does_to_its_state_dict_stays_in_that_message(tmp_path, reads):
    store = ClientStateStore(RecordDict(), 0, str(tmp_path), BIG)
    store.save("run", "ab", 1, {"w": np.ones(2), "pending": np.zeros(1)}, needed_from=0)
    first = store.load("run", "ab", 2)
    first.pop("pending")
    first["w"] = np.zeros(2)  # an evaluate message's changes, never saved
    assert store.load("run", "ab", 2).keys() == {"w", "pending"} and store.load("run", "ab", 2)["w"].tolist() == [1, 1]
    assert reads == []


def test_kept_state_stays_within_its_budget_and_keeps_the_partitions_it_holds(tmp_path, reads):
    """A budget of 24 bytes for states of 16: partition 0 is kept, then 1 is not (clients come round
    in turn: evicting 0 for 1 would miss both next round); 0's newer version replaces its older."""
    stores = [ClientStateStore(RecordDict(), p, str(tmp_path / "budget"), 24) for p in range(2)]
    for r in (1, 2):
        for store in stores:
            store.save("run", "ab", r, {"w": np.full(2, float(r))}, needed_from=r - 1)
        assert [s.load("run", "ab", r + 1)["w"][0] for s in stores] == [r, r]
    assert reads == ["round-1.ab.state", "round-2.ab.state"]  # partition 1's, each round
    assert ClientStateStore(RecordDict(), 0, str(tmp_path / "none"), 0).load("run", "ab", 2) == {}
    off = ClientStateStore(RecordDict(), 0, str(tmp_path / "off"), 0)
    off.save("run", "ab", 1, {"w": np.ones(2)}, needed_from=0)
    off.load("run", "ab", 2)
    assert reads[-1] == "round-1.ab.state" and len(reads) == 3


def fsynced(monkeypatch):
    """The paths fsynced, in order (files and directories)."""
    done = []
    original = storage.os.fsync

    def recording(fd):
        done.append(os.readlink(f"/proc/self/fd/{fd}"))
        return original(fd)

    monkeypatch.setattr(storage.os, "fsync", recording)
    return done


def test_a_simulated_client_replies_before_its_state_is_fsynced_a_deployments_after(tmp_path, monkeypatch):
    synced, later = fsynced(monkeypatch), []
    monkeypatch.setattr(storage, "sync_later", later.append)
    shared = tmp_path / "client-state"
    config = round_config(1, 0, "run", "ab", 0, str(shared), str(shared))
    client_state.run_marker(shared, "run", "ab").parent.mkdir(parents=True)
    client_state.run_marker(shared, "run", "ab").touch()
    for state_dir in ("", str(tmp_path / "own")):  # the server's (simulation), the node's own
        state = LocalState(ClientStateStore(RecordDict(), 0, state_dir))
        state.use(config, 1)
        state.arrays["w"] = np.ones(2)
        state.save(config)
    simulated, own = shared / "run" / "partition-0", tmp_path / "own" / "run" / "partition-0"
    assert later == [simulated / "round-1.ab.state"]
    assert not any(p.startswith(str(simulated)) for p in synced)
    assert str(own) in synced and any(p.startswith(str(own / ".round-1.ab.state.")) for p in synced)


def test_every_version_a_resume_reads_is_fsynced_before_the_checkpoint_that_names_it(tmp_path, monkeypatch):
    """The clients' background syncs never run here: the server's own sync must cover, before each
    checkpoint, each partition's newest version up to that round (what a resume from it reads)."""
    synced, writes = fsynced(monkeypatch), []
    monkeypatch.setattr(storage, "sync_later", lambda path: None)
    original = checkpoint.Checkpoint.save

    def save(self, directory):
        versions = sorted((directory / "client-state" / "r").glob("partition-*/round-*.state"))
        newest = {}
        for path in versions:
            r = int(path.name.split(".")[0].removeprefix("round-"))
            if r <= self.server_round and r > newest.get(path.parent, (0, None))[0]:
                newest[path.parent] = (r, path)
        writes.append((self.server_round, [str(path) for _, path in newest.values()], list(synced)))
        return original(self, directory)

    monkeypatch.setattr(checkpoint.Checkpoint, "save", save)
    config = {"method": "fedproto", "dataset": "digits", "num-server-rounds": 4, "fraction-fit": 0.5,
              "checkpoint-every": 2, "batch-size": 32, "output-dir": str(tmp_path), "run-name": "r"}
    run_in_process(config, num_nodes=4)
    assert [w[0] for w in writes] == [2, 4]
    for server_round, needed, synced_before in writes:
        assert needed and all(path in synced_before for path in needed), server_round


def test_a_ray_simulations_client_apps_keep_no_state_in_memory(tmp_path, kept_states, monkeypatch):
    """Ray hands a partition's messages to any ClientApp: each would hold every partition's state for
    about one hit in as many messages as there are ClientApps. A training worker's clients (all of
    its GPU's partitions in one process) and in-process runs keep it."""
    from protofl import client_app

    config = {"method": "fedproto", "dataset": "digits", "num-server-rounds": 1, "output-dir": str(tmp_path)}
    monkeypatch.setattr(client_app, "ray_cpus", lambda: 1)  # as in a Ray actor
    run_in_process(config | {"run-name": "ray"}, num_nodes=2)
    assert kept_states.entries == {}
    monkeypatch.undo()
    monkeypatch.setattr(client_state, "KEPT_STATES", kept_states)
    run_in_process(config | {"run-name": "in-process"}, num_nodes=2)
    assert len(kept_states.entries) == 2


def test_a_kept_model_moved_to_its_device_is_reset_from_copies_there():
    """The client moves its model to its device after it is kept: the values as built follow it once,
    so that a reset copies on the device, not from the host every message."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    key = ("a kept model moved to its device",)
    assert kept_models.kept_model(key, lambda: model) is model
    model.to("meta")
    kept_models.release_thread_models()
    assert kept_models.kept_model(key, lambda: None) is model
    initial = kept_models._models.models[key].initial
    assert initial.keys() == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                              "1.num_batches_tracked"}
    assert {t.device.type for t in initial.values()} == {"meta"}
    kept_models.release_thread_models()


# fast: a personal model, and SCAFFOLD's control variates (popped and updated in its state dict)
@pytest.mark.parametrize("method", ["fedproto", "scaffold"] + [
    pytest.param(m, marks=pytest.mark.slow) for m in ("fedala", "fedsa", "ditto", "fedpac", "fedcosr")])
def test_every_kept_state_equals_its_file_after_a_run(tmp_path, kept_states, method):
    """No method changes, in place, arrays it read from or saved to its state (a process hands the
    same arrays to the partition's next message): after fits and evaluations, each kept version
    equals its file."""
    config = {"dataset": "digits", "num-server-rounds": 2, "batch-size": 32, "output-dir": str(tmp_path)}
    run_in_process(config | {"method": method}, num_nodes=3)
    kept = list(kept_states.entries.values())
    assert len(kept) == 3
    for path, _, arrays, _ in kept:
        on_disk = storage.arrays_from_blob(storage.read_file(path))
        assert on_disk.keys() == arrays.keys(), path
        for name, array in arrays.items():
            np.testing.assert_array_equal(array, on_disk[name], err_msg=f"{path}: {name}")
