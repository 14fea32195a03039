"""What lets a run survive a crash: the server's checkpoint of a run, and the state each node keeps
for its partition across rounds. Both are written atomically and read back without pickle.

**Server.** ``<run directory>/checkpoint.npz`` after every ``checkpoint-every`` rounds: the round,
the global parameters, the method's server state (its ``state_fields``, whatever their values:
arrays, :class:`ClassVectors`, lists or dicts of them), the fixed number of partitions, the DP
release counts, the run's results so far and the settings it ran with. One file, so that it is
always a whole round's.

**Clients.** :class:`ClientStateStore`: named arrays (a personal model, FedSA's margin, ...) per
partition. In memory it is one blob in Flower's ``context.state`` (lost with the node's process);
with a ``state-dir`` it is a file per round that the partition trained in,
``<state-dir>/<run name>/partition-<id>/round-<r>.<run token>.npz``, and ``context.state`` holds
nothing. A client that trains in round r reads the newest version from before r, so a round that
a resumed run trains again starts from exactly what it started from the first time; versions the
server's last checkpoint no longer needs are deleted, as are other runs' (another run token).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from flwr.common import Parameters, parameters_to_ndarrays
from flwr.common.logger import log

from protofl.federation import wire
from protofl.federation.wire import ClassVectors
from protofl.task.storage import arrays_from_bytes, arrays_to_bytes, atomic_write, remove_partial_writes

CHECKPOINT = "checkpoint.npz"
CHECKPOINT_VERSION = 1
LAYOUT = "__layout__"


# ---------------------------------------------------------------------------------------
# State trees <-> named arrays
# ---------------------------------------------------------------------------------------


def encode_tree(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` as a JSON-able layout whose arrays are stored in ``arrays`` (by generated name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, np.ndarray):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"array": name}
    if isinstance(value, ClassVectors):
        return {"class_vectors": {f.name: encode_tree(getattr(value, f.name), arrays)
                                  for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {"dict": {str(k): encode_tree(v, arrays) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"list": [encode_tree(v, arrays) for v in value]}
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


def decode_tree(layout: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The value :func:`encode_tree` laid out."""
    (kind, content), = layout.items()
    if kind == "value":
        return content
    if kind == "array":
        return arrays[content]
    if kind == "class_vectors":
        return ClassVectors(**{name: decode_tree(v, arrays) for name, v in content.items()})
    if kind == "dict":
        return {k: decode_tree(v, arrays) for k, v in content.items()}
    if kind == "list":
        return [decode_tree(v, arrays) for v in content]
    raise ValueError(f"unknown checkpoint entry {kind!r}")


# ---------------------------------------------------------------------------------------
# The server's checkpoint
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Checkpoint:
    server_round: int  # the last complete round
    parameters: list[np.ndarray]  # the global parameters after it (the shared entries)
    strategy_state: dict[str, Any]
    results: dict[str, Any]  # results.json as of that round
    run_token: str  # names this run's client state (a fresh run gets a new one)

    def to_bytes(self) -> bytes:
        arrays: dict[str, np.ndarray] = {}
        layout = {
            "version": CHECKPOINT_VERSION,
            "server_round": self.server_round,
            "run_token": self.run_token,
            "results": self.results,
            "parameters": encode_tree(list(self.parameters), arrays),
            "strategy_state": encode_tree(self.strategy_state, arrays),
        }
        return arrays_to_bytes(arrays | {LAYOUT: np.frombuffer(json.dumps(layout).encode(), dtype=np.uint8)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Checkpoint":
        arrays = arrays_from_bytes(data)
        layout = json.loads(arrays.pop(LAYOUT).tobytes())
        if layout.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"checkpoint version {layout.get('version')!r}, this protofl reads {CHECKPOINT_VERSION}")
        return cls(
            server_round=int(layout["server_round"]),
            parameters=decode_tree(layout["parameters"], arrays),
            strategy_state=decode_tree(layout["strategy_state"], arrays),
            results=layout["results"],
            run_token=str(layout["run_token"]),
        )

    def save(self, directory: Path) -> int:
        """Write ``directory/checkpoint.npz`` atomically; returns its size in bytes."""
        data = self.to_bytes()
        atomic_write(Path(directory) / CHECKPOINT, data)
        return len(data)

    @classmethod
    def load(cls, directory: Path) -> "Checkpoint | None":
        """The run directory's checkpoint; None when it has none."""
        path = Path(directory) / CHECKPOINT
        return cls.from_bytes(path.read_bytes()) if path.is_file() else None


class RunCheckpoints:
    """The server's side of a run's checkpoints: when one is written (``checkpoint-every``, and
    after the last round), the run token that names this run's client state (a resumed run keeps
    it), and the round of the last one (the client state versions it still needs)."""

    def __init__(self, settings: Any, recorder: Any) -> None:
        self.every, self.last = settings.checkpoint_every, settings.num_server_rounds
        self.recorder = recorder
        self.run_token = secrets.token_hex(8)
        self.checkpointed_round = 0

    def run_identity(self, server_round: int) -> tuple[str, str, int]:
        """What a round's config tells the clients of this run: (its directory's name, its token, the
        last checkpointed round; every earlier round without checkpoints)."""
        checkpointed = self.checkpointed_round if self.every else server_round - 1
        return self.recorder.directory.name, self.run_token, checkpointed

    def save(self, server_round: int, parameters: Parameters, state: Callable[[], dict[str, Any]]) -> None:
        """After a complete round, when one is due: the checkpoint of ``parameters``, the server's
        ``state()`` and the results; its time and size are recorded in the round."""
        if not self.every or (server_round % self.every and server_round != self.last):
            return
        started = time.perf_counter()
        checkpoint = Checkpoint(server_round, parameters_to_ndarrays(parameters), state(),
                                self.recorder.results(), self.run_token)
        size = checkpoint.save(self.recorder.directory)
        self.checkpointed_round = server_round
        self.recorder.update(server_round, checkpoint_seconds=time.perf_counter() - started, checkpoint_bytes=size)
        self.recorder.write()

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue after ``checkpoint``'s round: its run token and results."""
        self.run_token, self.checkpointed_round = checkpoint.run_token, checkpoint.server_round
        self.recorder.restore(checkpoint.results, resumed_after=checkpoint.server_round)


# ---------------------------------------------------------------------------------------
# What a node keeps for its partition
# ---------------------------------------------------------------------------------------

MEMORY_RECORD = "protofl-state"
_VERSION_NAME = re.compile(r"round-(?P<round>\d+)\.(?P<token>[0-9a-f]*)\.npz")


def safe_name(text: str) -> str:
    """``text`` as one path component: letters, digits, ``._-`` (a run name comes from the server)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")
    return cleaned or "run"


class ClientStateStore:
    """Named arrays that one partition's client keeps across rounds; see the module's docstring.

    ``state``: Flower's ``context.state`` of the node (the in-memory store); ``directory``: the
    node's ``state-dir`` (then ``state`` is not used).
    """

    def __init__(self, state: Any, partition_id: int, directory: str = "") -> None:
        self.memory = state
        self.partition_id = partition_id
        self.directory = Path(directory).expanduser() if directory else None

    @staticmethod
    def _token(token: str) -> str:
        return re.sub(r"[^0-9a-f]", "", token)

    def _folder(self, run_name: str) -> Path:
        return self.directory / safe_name(run_name) / f"partition-{self.partition_id}"

    def _versions(self, folder: Path, token: str) -> dict[int, Path]:
        """This run's saved states by round (``token``: the run token, hex digits)."""
        versions = {}
        for path in folder.glob("*.npz") if folder.is_dir() else ():
            match = _VERSION_NAME.fullmatch(path.name)
            if match and match["token"] == token:
                versions[int(match["round"])] = path
        return versions

    def load(self, run_name: str, token: str, before: int | None) -> dict[str, np.ndarray]:
        """The newest state saved before round ``before`` (None: the newest of all); empty if none."""
        if self.directory is None:
            blob = self.memory.get(MEMORY_RECORD)
            return arrays_from_bytes(blob["arrays"]) if blob is not None else {}
        versions = self._versions(self._folder(run_name), self._token(token))
        usable = [r for r in versions if before is None or r < before]
        for server_round in sorted(usable, reverse=True):
            try:
                return arrays_from_bytes(versions[server_round].read_bytes())
            except (OSError, ValueError) as err:  # ours, written atomically: only a damaged disk
                log(WARNING, "protofl: partition %d's state of round %d is unreadable (%s)",
                    self.partition_id, server_round, err)
        return {}

    def save(self, run_name: str, token: str, server_round: int, arrays: Mapping[str, np.ndarray],
             needed_from: int) -> None:
        """Keep ``arrays`` as the state after ``server_round``. On disk, the versions a replay of
        any round after ``needed_from`` (the server's last checkpoint) may read stay; the others
        go, with other runs' versions and interrupted writes."""
        data = arrays_to_bytes(arrays)
        if self.directory is None:
            from flwr.app import ConfigRecord

            self.memory[MEMORY_RECORD] = ConfigRecord({"arrays": data})
            return
        folder, token = self._folder(run_name), self._token(token)
        atomic_write(folder / f"round-{server_round}.{token}.npz", data)
        versions = self._versions(folder, token)
        older = [r for r in versions if r <= needed_from]
        keep = {r for r in versions if r > needed_from} | ({max(older)} if older else set())
        kept = {versions[r] for r in keep}
        for path in folder.glob("*.npz"):
            if path not in kept:
                path.unlink(missing_ok=True)
        remove_partial_writes(folder)


# ---------------------------------------------------------------------------------------
# Starting a run: fresh, resumed, or refused
# ---------------------------------------------------------------------------------------


def open_run(settings: Any, directory: Path, option_defaults: Mapping[str, Any] | None = None) -> Checkpoint | None:
    """The checkpoint to continue from (``resume=true``), or None for a fresh start. A directory
    that holds a run already is never overwritten silently: it needs ``resume=true`` or
    ``overwrite=true``. Raises ``ValueError`` naming what to change. ``option_defaults``: the
    method's options' defaults, which a key the checkpoint lacks counts as."""
    directory = Path(directory)
    holds_a_run = (directory / "results.json").is_file() or (directory / CHECKPOINT).is_file()
    if not settings.resume:
        if holds_a_run and not settings.overwrite:
            raise ValueError(
                f"{directory} holds a run already: resume=true continues it, overwrite=true replaces it, "
                "or choose another run-name"
            )
        (directory / CHECKPOINT).unlink(missing_ok=True)
        return None
    checkpoint = Checkpoint.load(directory)
    if checkpoint is None:
        if holds_a_run:
            raise ValueError(f"resume=true: {directory} has results but no {CHECKPOINT} (checkpoint-every=0?)")
        log(INFO, "protofl: no checkpoint in %s yet; the run starts at round 1", directory)
        return None
    conflicts = settings.resume_conflicts(checkpoint.results["run_config"], option_defaults)
    if conflicts:
        raise ValueError(
            f"resume=true: the run config differs from the checkpoint's in {', '.join(conflicts)}; only "
            "num-server-rounds and checkpoint-every may change when a run resumes"
        )
    if checkpoint.server_round >= settings.num_server_rounds:
        raise ValueError(
            f"resume=true: {directory} is complete ({checkpoint.server_round} rounds); "
            "raise num-server-rounds to extend it"
        )
    return checkpoint


class LocalState:
    """What one client keeps for its partition across rounds (named arrays: a personal model, FedSA's
    margin, ...), as its store held it before a given round: read when first used, saved after a
    fit under that fit's round."""

    def __init__(self, store: ClientStateStore) -> None:
        self.store = store
        self.run: tuple[str, str] = ("", "")
        self.before: int | None = None
        self._arrays: dict[str, np.ndarray] | None = None

    def use(self, config: Mapping[str, Any], before: int) -> None:
        """From now on, the state the run that ``config`` names saved before round ``before``."""
        self.run, self.before, self._arrays = wire.run_identity(config), before, None

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = self.store.load(*self.run, self.before)
        return self._arrays

    def save(self, config: Mapping[str, Any]) -> None:
        """After the fit of ``config``'s round: what it holds, if anything."""
        if self._arrays:
            self.store.save(*self.run, wire.server_round(config), self._arrays, wire.checkpointed_round(config))
