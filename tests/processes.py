"""Find and kill the processes a test started (by PID, whole trees)."""

import os
import signal
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (not their descendants)."""
    return _children().get(pid, [])


def pids_with_argument(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (e.g. a test's temporary directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_trees(pids: list[int], grace: float = 5.0, signals=(signal.SIGTERM, signal.SIGKILL)) -> None:
    """SIGTERM each process and its descendants, then SIGKILL what is left after ``grace``
    (``signals=(signal.SIGKILL,)``: a crash, with no chance to clean up)."""
    tree = _children()
    everything: list[int] = []
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid not in everything:
            everything.append(pid)
            stack.extend(tree.get(pid, []))
    for sig in signals:
        for pid in everything:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in everything):
            time.sleep(0.1)
