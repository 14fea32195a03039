"""What lets a run survive a crash: the server's checkpoint of a run, and the state each node keeps
for its partition across rounds. Both are written atomically and read back without pickle.

**Server.** ``<run directory>/checkpoint.npz`` after every ``checkpoint-every`` rounds: the round,
the global parameters, the method's server state (its ``state_fields``, whatever their values:
arrays, :class:`ClassVectors`, lists or dicts of them), the fixed number of partitions, the DP
releases, the run's results so far and the settings it ran with. One file, so that it is
always a whole round's. With ``dp-noise``, ``<run directory>/dp-releases.json`` records each DP
release as it goes out (:class:`~protofl.task.privacy.ReleaseLedger`): a resumed run reads it, not
the checkpoint's copy, so that the releases between the checkpoint and a crash, which went out,
count as well as their replay.

**Clients.** :class:`ClientStateStore`: named arrays (a personal model, FedSA's margin, ...) per
partition, a file per round that the partition trained in,
``<state dir>/<run name>/partition-<id>/round-<r>.<run token>.npz``. The state dir is the node's
``state-dir`` (node config), else the run config's, else the one the server names in its
instructions in simulation (``<run directory>/client-state``), else, in a deployment,
``$FLWR_HOME/protofl-state`` (``~/.flwr/protofl-state``) of the process that runs the ClientApp;
a default one is created 0700. ``state-dir = "memory"`` keeps one blob in Flower's
``context.state`` instead, which a restarted node or a resumed run no longer has. A client that
trains in round r reads the newest version from before r, so a round that a resumed run trains
again starts from exactly what it started from the first time; versions the server's last
checkpoint no longer needs are deleted (at most the checkpointed one and those after it stay), as
are other runs' (another run token).

**Resume never lies.** A resumed run asks every node, with its partition id, for the round of the
newest state it holds; a partition that trained before the checkpoint but whose node holds no
state from its last training stops the run before its first round (:meth:`RunCheckpoints.lost_state`),
unless ``resume-fresh-clients = true`` lets those partitions start from fresh models (logged, and
recorded in results.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from flwr.common import Parameters, parameters_to_ndarrays
from flwr.common.logger import log

from protofl.federation import wire
from protofl.federation.state_disk import StateDiskCheck
from protofl.federation.wire import ClassVectors
from protofl.task.privacy import RELEASES_FILE
from protofl.task.storage import arrays_from_bytes, arrays_to_bytes, atomic_write, remove_partial_writes

CHECKPOINT = "checkpoint.npz"
CLIENT_STATE = "client-state"  # in the run directory: the simulated nodes' state
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

    def __init__(self, settings: Any, recorder: Any, client_state_dir: str = "",
                 state_bytes: Callable[[int], int] | None = None) -> None:
        """``client_state_dir``: where nodes that set no ``state-dir`` keep their state (simulation:
        in the run directory); empty in a deployment, whose nodes choose their own. ``state_bytes``:
        :class:`StateDiskCheck`'s."""
        self.every, self.last = settings.checkpoint_every, settings.num_server_rounds
        self.fresh_clients_allowed = settings.resume_fresh_clients
        self.recorder = recorder
        self.client_state_dir = client_state_dir
        # the state dir on this machine's disks (a simulation's: its nodes run here), not memory
        local = None if not client_state_dir or settings.state_dir == MEMORY else settings.state_dir or client_state_dir
        self.state_disk = StateDiskCheck(local and Path(local).expanduser(), self.every, state_bytes)
        # where the clients' state is, for the error that says it is missing
        self.state_location = (
            "memory (state-dir='memory'), which restarted nodes no longer have" if settings.state_dir == MEMORY
            else settings.state_dir or client_state_dir
            or "their nodes' state dirs (node config state-dir; default $FLWR_HOME/protofl-state where ClientApps run)"
        )
        self.run_token = secrets.token_hex(8)
        self.checkpointed_round = 0
        self.last_trained: dict[int, int] = {}  # partition -> the last round it replied to a fit
        self.to_check: dict[int, int] | None = None  # after a resume: last_trained of the checkpoint

    def run_identity(self, server_round: int) -> tuple[str, str, int, str]:
        """What a round's config tells the clients of this run: (its directory's name, its token, the
        last checkpointed round (every earlier round without checkpoints), the default state dir)."""
        checkpointed = self.checkpointed_round if self.every else server_round - 1
        return self.recorder.directory.name, self.run_token, checkpointed, self.client_state_dir

    def round_config(self, server_round: int, seed: int) -> dict[str, Any]:
        """The scalars of an instruction of this run (:func:`wire.round_config`)."""
        return wire.round_config(server_round, seed, *self.run_identity(server_round))

    def trained(self, server_round: int, partitions: Iterable[int]) -> None:
        """``partitions`` replied to ``server_round``'s fit: each saved its state after it."""
        self.last_trained.update((p, server_round) for p in partitions)

    def state(self) -> np.ndarray:
        """:attr:`last_trained` as (partition, round) rows, for the checkpoint."""
        return np.array(sorted(self.last_trained.items()), dtype=np.int64).reshape(-1, 2)

    def lost_state(self, state_rounds: Mapping[int, int | None]) -> list[int]:
        """After a resume, among the partitions not checked yet whose nodes report the round of their
        newest state (``state_rounds``; None: no report), those that trained before the checkpoint
        and hold no state from their last training. Each partition is checked once."""
        if self.to_check is None:
            return []
        lost = sorted(p for p, held in state_rounds.items()
                      if p in self.to_check and (held or 0) < self.to_check[p])
        for p in state_rounds:
            self.to_check.pop(p, None)
        return lost

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

    def check_client_state(self, state_rounds: Mapping[int, int | None]) -> str | None:
        """Why the run cannot go on, or None: state that will not fit its disk (:class:`StateDiskCheck`),
        or after a resume, partitions whose nodes lost their state (:meth:`lost_state`), which with
        ``resume-fresh-clients`` are logged and recorded in results.json (``fresh_clients``) instead."""
        if too_big := self.state_disk.refusal(state_rounds):
            return too_big
        lost = self.lost_state(state_rounds)
        if not lost:
            return None
        partitions = f"partition{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
        what = (f"{partitions} trained before round {self.checkpointed_round + 1}, but "
                f"their nodes hold no state of this run from their last training (personal models, ...) in "
                f"{self.state_location}")
        if not self.fresh_clients_allowed:
            return (f"resume=true: {what}. Their replayed rounds would differ from the uninterrupted run's: "
                    "restore that state, or set resume-fresh-clients=true to go on with fresh clients")
        log(WARNING, "protofl: resume-fresh-clients: %s; they start again from fresh models", what)
        self.recorder.extra.setdefault("fresh_clients", []).append(
            {"after_round": self.checkpointed_round, "partitions": lost})
        return None

    def restore(self, checkpoint: Checkpoint, last_trained: np.ndarray | None, keeps_client_state: bool) -> None:
        """Continue after ``checkpoint``'s round: its run token, results and, for a method whose
        clients keep state, the partitions whose state to check (``last_trained``: the
        checkpoint's :meth:`state`; a checkpoint from before it existed: every partition sampled)."""
        self.run_token, self.checkpointed_round = checkpoint.run_token, checkpoint.server_round
        self.recorder.restore(checkpoint.results, resumed_after=checkpoint.server_round)
        if last_trained is not None:
            self.last_trained = {int(p): int(r) for p, r in np.asarray(last_trained).reshape(-1, 2)}
        else:
            for record in checkpoint.results.get("rounds", []):
                self.trained(int(record["round"]), record.get("clients", []))
        self.to_check = dict(self.last_trained) if keeps_client_state else None


# ---------------------------------------------------------------------------------------
# What a node keeps for its partition
# ---------------------------------------------------------------------------------------

MEMORY = "memory"  # the state-dir that keeps a node's state in Flower's context.state
MEMORY_RECORD = "protofl-state"
_VERSION_NAME = re.compile(r"round-(?P<round>\d+)\.(?P<token>[0-9a-f]*)\.npz")


def safe_name(text: str) -> str:
    """``text`` as one path component: letters, digits, ``._-`` (a run name comes from the server)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")
    return cleaned or "run"


def node_state_directory() -> Path:
    """A deployment node's default state dir: ``protofl-state`` in the Flower home of the process
    that runs the ClientApp (``$FLWR_HOME``, else ``~/.flwr``, as Flower's own)."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser() / "protofl-state"


class ClientStateStore:
    """Named arrays that one partition's client keeps across rounds; see the module's docstring.

    ``state``: Flower's ``context.state`` of the node (used with ``state-dir = "memory"``);
    ``state_dir``: the node's or the run's ``state-dir``; empty: the default, which :meth:`locate`
    takes from an instruction.
    """

    def __init__(self, state: Any, partition_id: int, state_dir: str = "") -> None:
        self.memory = state
        self.partition_id = partition_id
        self.state_dir = state_dir
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

    @staticmethod
    def _token(token: str) -> str:
        return re.sub(r"[^0-9a-f]", "", token)

    def _folder(self, directory: Path, run_name: str) -> Path:
        return directory / safe_name(run_name) / f"partition-{self.partition_id}"

    def _versions(self, run_name: str, token: str, before: int | None) -> dict[int, Path | None]:
        """This run's saved states by round (``token``: the run token), those before round
        ``before`` (None: all); in memory, the one blob's round (a None path)."""
        directory = self.directory
        if directory is None:
            blob = self.memory.get(MEMORY_RECORD)
            versions: dict[int, Path | None] = {int(blob.get("round", 0)): None} if blob is not None else {}
        else:
            folder, versions = self._folder(directory, run_name), {}
            for path in folder.glob("*.npz") if folder.is_dir() else ():
                match = _VERSION_NAME.fullmatch(path.name)
                if match and match["token"] == self._token(token):
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
            try:
                data = self.memory[MEMORY_RECORD]["arrays"] if path is None else path.read_bytes()
                return arrays_from_bytes(data)
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
        directory = self.directory
        if directory is None:
            from flwr.app import ConfigRecord

            self.memory[MEMORY_RECORD] = ConfigRecord({"arrays": data, "round": server_round})
            return
        if not self.state_dir:  # a default one: only this node's user may enter it
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = self._folder(directory, run_name)
        atomic_write(folder / f"round-{server_round}.{self._token(token)}.npz", data)
        versions = self._versions(run_name, token, None)
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
    has_results = (directory / "results.json").is_file()
    holds_a_run = has_results or (directory / CHECKPOINT).is_file() or (directory / RELEASES_FILE).is_file()
    if not settings.resume:
        if holds_a_run and not settings.overwrite:
            raise ValueError(
                f"{directory} holds a run already: resume=true continues it, overwrite=true replaces it, "
                "or choose another run-name"
            )
        (directory / CHECKPOINT).unlink(missing_ok=True)
        (directory / RELEASES_FILE).unlink(missing_ok=True)  # a replaced run's privacy is not this run's
        shutil.rmtree(directory / CLIENT_STATE, ignore_errors=True)  # a replaced run's
        return None
    checkpoint = Checkpoint.load(directory)
    if checkpoint is None:
        if has_results:
            raise ValueError(f"resume=true: {directory} has results but no {CHECKPOINT} (checkpoint-every=0?)")
        log(INFO, "protofl: no checkpoint in %s yet; the run starts at round 1", directory)
        return None
    conflicts = settings.resume_conflicts(checkpoint.results["run_config"], option_defaults)
    if conflicts:
        raise ValueError(
            f"resume=true: the run config differs from the checkpoint's in {', '.join(conflicts)}; only "
            "num-server-rounds, checkpoint-every, resume-fresh-clients, tracker and mlflow-uri may change when a run "
            "resumes"
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
        self.store.locate(config)

    def held(self, config: Mapping[str, Any]) -> dict[str, int]:
        """Asked with a run's identity (the server's discovery): the round of the newest state held
        for the run's next round (``STATE_ROUND``; 0: none); else nothing."""
        if wire.RUN_TOKEN not in config:
            return {}
        self.use(config, wire.checkpointed_round(config) + 1)
        return {wire.STATE_ROUND: self.store.newest_round(*self.run, self.before)}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = self.store.load(*self.run, self.before)
        return self._arrays

    def save(self, config: Mapping[str, Any]) -> None:
        """After the fit of ``config``'s round: what it holds, if anything."""
        if self._arrays:
            self.store.save(*self.run, wire.server_round(config), self._arrays, wire.checkpointed_round(config))
