"""What lets a run survive a crash: the server's checkpoint of a run, and the state each node keeps
for its partition across rounds (:mod:`protofl.federation.client_state`). Both are written
atomically and read back without pickle.

**Server.** ``<run directory>/checkpoint.npz`` after every ``checkpoint-every`` rounds: the round,
the global parameters, the method's server state (its ``state_fields``, whatever their values:
arrays, :class:`ClassVectors`, lists or dicts of them, torch tensors, modules and optimizers as
their ``state_dict``, :mod:`protofl.federation.server_state`), the fixed number of partitions, the DP
releases, the run's results so far and the settings it ran with. One file, so that it is
always a whole round's. With ``dp-noise``, ``<run directory>/dp-releases.json`` records each DP
release as it goes out (:class:`~protofl.task.privacy.ReleaseLedger`): a resumed run reads it, not
the checkpoint's copy, so that the releases between the checkpoint and a crash, which went out,
count as well as their replay.

**Clients.** What a node keeps for its partition across rounds is in
:mod:`protofl.federation.client_state`; the server's side of it is here: the run token that names
a run's client state, the marker a simulation places in the clients' state dir, and the check that
a resumed run finds its clients' state again.

**Resume never lies.** A resumed run asks every node, with its partition id, for the round of the
newest state it holds; a partition that trained before the checkpoint but whose node holds no
state from its last training stops the run before its first round (:meth:`RunCheckpoints.lost_state`),
unless ``resume-fresh-clients = true`` lets those partitions start from fresh models (logged, and
recorded in results.json).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from flwr.common.logger import log

from protofl.federation import wire
from protofl.federation.client_state import MEMORY, not_shared_line, run_marker, sync_state_versions
from protofl.federation.code_identity import running_digest
from protofl.federation.state_disk import StateDiskCheck
from protofl.federation.wire import ClassVectors
from protofl.task.privacy import RELEASES_FILE
from protofl.task.storage import arrays_from_bytes, arrays_to_bytes, atomic_write

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
    if isinstance(value, torch.Tensor):  # a server-side module's or optimizer's (MethodState)
        return {"tensor": encode_tree(value.detach().cpu().numpy(), arrays)["array"]}
    if isinstance(value, ClassVectors):
        return {"class_vectors": {f.name: encode_tree(getattr(value, f.name), arrays)
                                  for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        if value and all(type(k) is int for k in value):  # an optimizer's state, by parameter index
            return {"int_dict": [[k, encode_tree(v, arrays)] for k, v in value.items()]}
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
    if kind == "tensor":
        return torch.from_numpy(np.array(arrays[content]))
    if kind == "class_vectors":
        return ClassVectors(**{name: decode_tree(v, arrays) for name, v in content.items()})
    if kind == "dict":
        return {k: decode_tree(v, arrays) for k, v in content.items()}
    if kind == "int_dict":
        return {int(k): decode_tree(v, arrays) for k, v in content}
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
        self.marked_state_dir = local or ""  # where the run's marker goes (run_marker)
        self.marker_placed = ""  # the run token it was placed for
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

    def unshared_state(self, failures: Iterable[str]) -> str | None:
        """A simulated client's :class:`StateDirNotShared` line among ``failures`` (the texts of a
        round's failed messages), or None. In a deployment, where no state dir is marked and
        failure texts come from nodes the server does not control, always None."""
        if not self.marked_state_dir:
            return None
        return next((line for text in failures if (line := not_shared_line(text))), None)

    def run_identity(self, server_round: int) -> tuple[str, str, int, str]:
        """What a round's config tells the clients of this run: (its directory's name, its token, the
        last checkpointed round (every earlier round without checkpoints), the default state dir)."""
        checkpointed = self.checkpointed_round if self.every else server_round - 1
        return self.recorder.directory.name, self.run_token, checkpointed, self.client_state_dir

    def round_config(self, server_round: int, seed: int) -> dict[str, Any]:
        """The scalars of an instruction of this run (:func:`wire.round_config`); the first places
        the run's marker in the clients' state dir (simulation)."""
        if self.marked_state_dir and self.marker_placed != self.run_token:
            directory = Path(self.marked_state_dir).expanduser()
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # as a client makes a default one
            marker = run_marker(directory, self.recorder.directory.name, self.run_token)
            marker.parent.mkdir(exist_ok=True)
            marker.touch()
            self.marker_placed = self.run_token
        code = running_digest() if self.client_state_dir else ""  # simulation: the clients run this code too
        return wire.round_config(server_round, seed, *self.run_identity(server_round), self.marked_state_dir, code)

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

    def save(self, server_round: int, parameters: list[np.ndarray], state: Callable[[], dict[str, Any]]) -> None:
        """After a complete round, when one is due: the checkpoint of ``parameters``, the server's
        ``state()`` and the results, after the client state versions a resume from it reads (those of
        the partitions that trained since the last one) are synced; its time (the sync's included)
        and size are recorded in the round."""
        if not self.every or (server_round % self.every and server_round != self.last):
            return
        started = time.perf_counter()
        if self.marked_state_dir:  # the clients fsync their versions in the background: these must be on disk now
            since = {p: r for p, r in self.last_trained.items() if r > self.checkpointed_round}
            sync_state_versions(Path(self.marked_state_dir).expanduser(), self.recorder.directory.name,
                                self.run_token, since)
        checkpoint = Checkpoint(server_round, list(parameters), state(),
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
            "num-server-rounds, checkpoint-every, resume-fresh-clients, tracker, mlflow-uri, clients-in-flight, "
            "kept-state-mb and flower-api may change when a run resumes"
        )
    if checkpoint.server_round >= settings.num_server_rounds:
        raise ValueError(
            f"resume=true: {directory} is complete ({checkpoint.server_round} rounds); "
            "raise num-server-rounds to extend it"
        )
    return checkpoint
