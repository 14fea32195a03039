"""Will the clients' state fit on its disk? Checked once, before the first round a server process
runs, where the server sees that disk: a simulation's state dir (its nodes run on this machine),
not a deployment's nodes' own disks, nor ``state-dir = "memory"``."""

from __future__ import annotations

import shutil
from logging import WARNING
from pathlib import Path
from typing import Callable, Iterable

from flwr.common.logger import log


def state_versions_kept(checkpoint_every: int) -> int:
    """The most state files one partition holds at once (:class:`ClientStateStore`): one per round
    since the last checkpoint (``checkpoint_every``; 1 without checkpoints), the newest from before
    it, and one being written."""
    return max(checkpoint_every, 1) + 2


def existing_ancestor(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (a directory not made yet is on its disk)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class StateDiskCheck:
    """``directory``: the state dir, where this machine holds it (else None); ``checkpoint_every``:
    the run's; ``state_bytes(partition)``: about what one version of a partition's state takes (its
    model), None for clients that keep no state. Without either there is nothing to check."""

    def __init__(self, directory: Path | None, checkpoint_every: int, state_bytes: Callable[[int], int] | None) -> None:
        self.directory, self.every = directory, checkpoint_every
        self.state_bytes = state_bytes if directory is not None else None

    def refusal(self, partitions: Iterable[int]) -> str | None:
        """The first time: why the state of ``partitions`` would not fit, or None; a warning when it
        would take more than half of the free space. Later: None."""
        if self.state_bytes is None:
            return None
        sizes, self.state_bytes = [self.state_bytes(p) for p in partitions], None
        versions = state_versions_kept(self.every)
        projected = sum(sizes) * versions
        free = shutil.disk_usage(existing_ancestor(self.directory)).free
        what = (f"the clients' state needs up to {projected / 2**20:,.1f} MiB ({len(sizes)} partitions x "
                f"{sum(sizes) / max(len(sizes), 1) / 2**20:,.1f} MiB x {versions} versions kept, "
                f"checkpoint-every={self.every}) in {self.directory}, whose disk has {free / 2**20:,.1f} MiB free")
        if projected > free:
            return (f"{what}: free space there, set state-dir to a larger disk, or state-dir='memory' "
                    "(a resumed run then cannot replay its clients)")
        if projected > free / 2:
            log(WARNING, "protofl: %s", what)
        return None
