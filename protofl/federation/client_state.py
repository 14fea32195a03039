"""What a node keeps for its partition across rounds.

:class:`ClientStateStore`: named arrays (a personal model, FedSA's margin, ...) per
partition, a file per round that the partition trained in,
``<state dir>/<run name>/partition-<id>/round-<r>.<run token>.state`` (an array blob,
:func:`protofl.task.storage.arrays_from_blob`; ``.npz`` files of earlier versions are read too).
The state dir is the node's ``state-dir`` (node config), else the run config's, else the one the server names in its
instructions in simulation (``<run directory>/client-state``), else, in a deployment,
``$FLWR_HOME/protofl-state`` (``~/.flwr/protofl-state``) of the process that runs the ClientApp;
a default one is created 0700. ``state-dir = "memory"`` keeps one blob in Flower's
``context.state`` instead, which a restarted node or a resumed run no longer has. A client that
trains in round r reads the newest version from before r, so a round that a resumed run trains
again starts from exactly what it started from the first time; versions the server's last
checkpoint no longer needs are deleted (at most the checkpointed one and those after it stay), as
are other runs' (another run token).

**One state dir for every node.** In a simulation the ServerApp places a marker of the run in the
clients' state dir before its first round; a client keeping its state on disk there refuses
(:class:`StateDirNotShared`) when it does not see the marker: on a Ray cluster whose nodes do not
share that directory, or a relative state dir a Ray worker resolves elsewhere, its state would
silently be fresh or stale. The ServerApp then stops the run with that one line.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from logging import WARNING
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flwr.common.logger import log

from protofl.federation import wire
from protofl.federation.code_identity import check_same_code
from protofl.task.storage import (
    array_blob_parts,
    arrays_from_blob,
    arrays_from_bytes,
    arrays_to_blob,
    atomic_write,
    read_file,
    remove_partial_writes,
    sync_files,
)

MEMORY = "memory"  # the state-dir that keeps a node's state in Flower's context.state
MEMORY_RECORD = "protofl-state"
_VERSION_NAME = re.compile(r"round-(?P<round>\d+)\.(?P<token>[0-9a-f]*)\.(state|npz)")


def safe_name(text: str) -> str:
    """``text`` as one path component: letters, digits, ``._-`` (a run name comes from the server)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")
    return cleaned or "run"


NOT_SHARED = "is not shared with the ServerApp"


class StateDirNotShared(RuntimeError):
    """A simulated client's state dir is not the one the ServerApp marked (another node's disk)."""


_NOT_SHARED_LINE = re.compile(rf"state-dir [^'\n]*? {NOT_SHARED}[^'\n]*")


def not_shared_line(text: str) -> str | None:
    """The :class:`StateDirNotShared` line in the text of a failed message, or None."""
    match = _NOT_SHARED_LINE.search(text)
    return match.group(0) if match else None


def token_digits(token: str) -> str:
    """A run token as it appears in file names: its hex digits only (it comes from the server)."""
    return re.sub(r"[^0-9a-f]", "", token)


def run_marker(directory: Path, run_name: str, token: str) -> Path:
    """The file a simulation's ServerApp places in the clients' state dir at its start."""
    return directory / safe_name(run_name) / f".run-{token_digits(token)}"


def node_state_directory() -> Path:
    """A deployment node's default state dir: ``protofl-state`` in the Flower home of the process
    that runs the ClientApp (``$FLWR_HOME``, else ``~/.flwr``, as Flower's own)."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser() / "protofl-state"


def _file_identity(path: Path) -> tuple[int, ...]:
    status = path.stat()
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


class KeptStates:
    """The state version each partition's client saved or read last in this process, by partition
    folder, with its file's identity (device, inode, size, times): a load that finds that file
    still the newest version takes these arrays (a new dict of them) instead of reading it. Up to
    a byte budget per call: when full, a partition not kept yet is not kept (clients come round in
    turn; evicting the oldest would evict each one before its next message)."""

    def __init__(self) -> None:
        self.entries: dict[Path, tuple[Path, tuple[int, ...], dict[str, np.ndarray], int]] = {}
        self.held = 0  # bytes
        self.lock = threading.Lock()

    def clear(self) -> None:
        """Keep nothing (as a process starting anew)."""
        with self.lock:
            self.entries, self.held = {}, 0

    def get(self, path: Path) -> dict[str, np.ndarray] | None:
        with self.lock:
            entry = self.entries.get(path.parent)
        if entry is None or entry[0] != path:
            return None
        try:
            same = _file_identity(path) == entry[1]
        except OSError:
            same = False
        return dict(entry[2]) if same else None

    def put(self, path: Path, arrays: Mapping[str, np.ndarray], budget: int) -> None:
        size = sum(np.asarray(a).nbytes for a in arrays.values())
        try:
            identity = _file_identity(path)
        except OSError:
            return
        with self.lock:
            old = self.entries.pop(path.parent, None)
            self.held -= old[3] if old else 0
            if self.held + size <= budget:
                self.entries[path.parent] = (path, identity, dict(arrays), size)
                self.held += size


KEPT_STATES = KeptStates()  # this process's


def partition_folder(directory: Path, run_name: str, partition_id: int) -> Path:
    """Where a partition's state versions of a run go in the state dir ``directory``."""
    return directory / safe_name(run_name) / f"partition-{partition_id}"


def version_name(server_round: int, token: str) -> str:
    """The file name of the state version after ``server_round`` of the run whose token is ``token``."""
    return f"round-{server_round}.{token_digits(token)}.state"


def sync_state_versions(directory: Path, run_name: str, token: str, rounds: Mapping[int, int]) -> None:
    """fsync the state versions ``rounds`` names (partition -> the round of its version) in the
    state dir ``directory``: those a resume from the checkpoint about to be written reads. A
    version that is not there (a method that keeps no state, a node with a state dir of its own,
    whose client synced it) is skipped."""
    sync_files([partition_folder(directory, run_name, partition) / version_name(r, token)
                for partition, r in rounds.items()])


class ClientStateStore:
    """Named arrays that one partition's client keeps across rounds; see the module's docstring.

    ``state``: Flower's ``context.state`` of the node (used with ``state-dir = "memory"``);
    ``state_dir``: the node's or the run's ``state-dir``; empty: the default, which :meth:`locate`
    takes from an instruction; ``kept_bytes``: what :data:`KEPT_STATES` may hold (0: nothing).
    """

    def __init__(self, state: Any, partition_id: int, state_dir: str = "", kept_bytes: int = 0) -> None:
        self.memory = state
        self.partition_id = partition_id
        self.state_dir = state_dir
        self.kept_bytes = kept_bytes  # the budget of KEPT_STATES (the run's kept-state-mb)
        self.suggested = ""  # the server's default for this run (simulation), from an instruction

    def locate(self, config: Mapping[str, Any]) -> None:
        """Take the default state dir of the run that ``config`` belongs to."""
        self.suggested = wire.client_state_dir(config)

    @property
    def directory(self) -> Path | None:
        """Where the state files go (created by the first save); None: in memory."""
        if self.state_dir == MEMORY:
            return None
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        return Path(self.suggested) if self.suggested else node_state_directory()

    def keeps_in(self, marked: str) -> bool:
        """Whether this store keeps its state in ``marked``, the state dir the ServerApp marked (a
        simulation's), which the server also syncs before its checkpoints."""
        directory = self.directory
        return bool(marked) and directory is not None and directory == Path(marked).expanduser()

    def check_shared(self, run_name: str, token: str, marked: str) -> None:
        """Raises :class:`StateDirNotShared` when this store keeps its state in ``marked`` (the
        state dir the ServerApp marked) but does not see the run's marker there."""
        if not self.keeps_in(marked):
            return
        directory = self.directory
        if not run_marker(directory, run_name, token).is_file():
            raise StateDirNotShared(
                f"state-dir {directory} {NOT_SHARED}: the ClientApp on {socket.gethostname()} does not see "
                "the marker the ServerApp placed there at the start of the run. Every node needs that "
                "directory at the same path (a shared filesystem, state-dir=PATH), or state-dir=memory "
                "keeps the state of each client in its Flower context")

    def _versions(self, run_name: str, token: str, before: int | None) -> dict[int, Path | None]:
        """This run's saved states by round (``token``: the run token), those before round
        ``before`` (None: all); in memory, the one blob's round (a None path)."""
        directory = self.directory
        if directory is None:
            blob = self.memory.get(MEMORY_RECORD)
            versions: dict[int, Path | None] = {int(blob.get("round", 0)): None} if blob is not None else {}
        else:
            folder, versions = partition_folder(directory, run_name, self.partition_id), {}
            for path in sorted(folder.iterdir(), key=lambda p: p.suffix == ".state") if folder.is_dir() else ():
                match = _VERSION_NAME.fullmatch(path.name)
                if match and match["token"] == token_digits(token):
                    versions[int(match["round"])] = path
        return {r: path for r, path in versions.items() if before is None or r < before}

    def newest_round(self, run_name: str, token: str, before: int | None) -> int:
        """The round of the newest state saved before round ``before`` (None: of all); 0: none."""
        return max(self._versions(run_name, token, before), default=0)

    def load(self, run_name: str, token: str, before: int | None) -> dict[str, np.ndarray]:
        """The newest state saved before round ``before`` (None: the newest of all); empty if none."""
        versions = self._versions(run_name, token, before)
        for server_round in sorted(versions, reverse=True):
            path = versions[server_round]
            if path is not None and (kept := KEPT_STATES.get(path)) is not None:
                return kept
            try:
                data = bytearray(self.memory[MEMORY_RECORD]["arrays"]) if path is None else read_file(path)
                arrays = arrays_from_bytes(bytes(data)) if data[:2] == b"PK" else arrays_from_blob(data)
                if path is not None:
                    KEPT_STATES.put(path, arrays, self.kept_bytes)
                return arrays
            except (OSError, ValueError) as err:  # ours, written atomically: only a damaged disk
                log(WARNING, "protofl: partition %d's state of round %d is unreadable (%s)",
                    self.partition_id, server_round, err)
        return {}

    def save(self, run_name: str, token: str, server_round: int, arrays: Mapping[str, np.ndarray],
             needed_from: int, durable: bool = True) -> None:
        """Keep ``arrays`` as the state after ``server_round``. On disk, the versions a replay of
        any round after ``needed_from`` (the server's last checkpoint) may read stay; the others
        go, with other runs' versions and interrupted writes. ``durable=False``: the file is fsynced
        in the background (the server syncs it before its next checkpoint)."""
        directory = self.directory
        if directory is None:
            from flwr.app import ConfigRecord

            self.memory[MEMORY_RECORD] = ConfigRecord({"arrays": arrays_to_blob(arrays), "round": server_round})
            return
        if not self.state_dir:  # a default one: only this node's user may enter it
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = partition_folder(directory, run_name, self.partition_id)
        path = folder / version_name(server_round, token)
        atomic_write(path, array_blob_parts(arrays), durable=durable)
        KEPT_STATES.put(path, arrays, self.kept_bytes)
        versions = self._versions(run_name, token, None)
        older = [r for r in versions if r <= needed_from]
        keep = {r for r in versions if r > needed_from} | ({max(older)} if older else set())
        kept = {versions[r] for r in keep}
        for path in folder.iterdir():
            if _VERSION_NAME.fullmatch(path.name) and path not in kept:
                path.unlink(missing_ok=True)
        remove_partial_writes(folder)


class LocalState:
    """What one client keeps for its partition across rounds (named arrays: a personal model, FedSA's
    margin, ...), as its store held it before a given round: read when first used, saved after a
    fit under that fit's round."""

    def __init__(self, store: ClientStateStore) -> None:
        self.store = store
        self.run: tuple[str, str] = ("", "")
        self.marked = ""  # the state dir the ServerApp marked (wire.marked_state_dir)
        self.before: int | None = None
        self._arrays: dict[str, np.ndarray] | None = None

    def use(self, config: Mapping[str, Any], before: int) -> None:
        """From now on, the state the run that ``config`` names saved before round ``before``; a
        client whose code is not the ServerApp's refuses (:func:`check_same_code`)."""
        check_same_code(config)
        self._locate(config, before)

    def _locate(self, config: Mapping[str, Any], before: int) -> None:
        located = (wire.run_identity(config), before, wire.marked_state_dir(config), wire.client_state_dir(config))
        if located != (self.run, self.before, self.marked, self.store.suggested):  # else: what was read stays
            self._arrays = None
        self.run, self.before, self.marked = located[:3]
        self.store.locate(config)

    def held(self, config: Mapping[str, Any]) -> dict[str, int]:
        """Asked with a run's identity (the server's discovery): the round of the newest state held
        for the run's next round (``STATE_ROUND``; 0: none); else nothing."""
        if wire.RUN_TOKEN not in config:
            return {}
        self._locate(config, wire.checkpointed_round(config) + 1)  # code checked by the fit that follows
        return {wire.STATE_ROUND: self.store.newest_round(*self.run, self.before)}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self.store.check_shared(*self.run, self.marked)
            self._arrays = self.store.load(*self.run, self.before)
        return self._arrays

    def save(self, config: Mapping[str, Any]) -> None:
        """After the fit of ``config``'s round: what it holds, if anything."""
        if self._arrays:
            self.store.check_shared(*self.run, self.marked)
            # the server syncs the state dir it marked before its next checkpoint; another one, here
            self.store.save(*self.run, wire.server_round(config), self._arrays, wire.checkpointed_round(config),
                            durable=not self.store.keeps_in(self.marked))
