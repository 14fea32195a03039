"""The managed local SuperLink that `flwr run` starts for a ``:local:`` connection, found by its
port, and whether it can still serve this environment.

`flwr run` reuses whatever SuperLink answers on ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` (default
39091), with the directory, Flower home and environment it was started from. A SuperLink started
from a checkout that was then deleted (and cloned again at the same path, which gets the same ports
from ``./setup.sh``) starts every run's task in a directory that no longer exists. There the task
exits at ``import torch`` (oneMKL: "FATAL ERROR: Cannot load .../libtorch_cpu.so", exit code 2)
before its first round and before it can report; its output is discarded, and the run ends
``finished:failed`` with "No heartbeat received from the task" while `flwr run` exits 0.

``python -m protofl.local_superlink`` (run by ``./setup.sh``) ends such a SuperLink, and
``protofl run`` checks before each run. Linux only (``/proc``); elsewhere nothing is found.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_HTTP_PORT = "39091"  # flwr.cli.constant.LOCAL_SUPERLINK_HTTP_API_PORT's default


@dataclasses.dataclass(frozen=True)
class ManagedSuperLink:
    pid: int
    argv: list[str]
    directory: str  # its working directory, " (deleted)" at the end when it is gone
    flwr_home: str | None

    def option(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv[:-1] else None

    @property
    def gone_directory(self) -> str | None:
        """The directory it was started from, when that is gone."""
        return self.directory.removesuffix(" (deleted)") if self.directory.endswith(" (deleted)") else None

    @property
    def bin_directory(self) -> Path:
        """The environment it runs in: the directory of its ``flower-superlink`` script."""
        script = next(a for a in self.argv if Path(a).name == "flower-superlink")
        return Path(script).parent


def http_port() -> str:
    return os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", DEFAULT_HTTP_PORT)


def find() -> ManagedSuperLink | None:
    """The ``flower-superlink`` process serving this environment's port on this machine, if any."""
    port = http_port()
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else []:
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            if not any(Path(a).name == "flower-superlink" for a in argv) or "--port" not in argv[:-1]:
                continue
            if argv[argv.index("--port") + 1] != port:
                continue
            environ = _environ(int(entry.name)) or {}
            return ManagedSuperLink(int(entry.name), argv, os.readlink(entry / "cwd"), environ.get("FLWR_HOME"))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return None


def problem(superlink: ManagedSuperLink, bin_directory: Path | None = None) -> tuple[str, bool] | None:
    """Why ``superlink`` cannot serve a run of this environment, and whether it is stale (what it
    was started from is gone, so no one can use it) rather than another environment's; None if it can."""
    database = superlink.option("--database")
    if superlink.gone_directory:
        return f"the directory it was started from, {superlink.gone_directory}, is gone", True
    if database and not Path(database).parent.is_dir():
        return f"its Flower home ({Path(database).parent.parent}) is gone", True
    if not superlink.bin_directory.is_dir():
        return f"its environment ({superlink.bin_directory}) is gone", True
    ours = (bin_directory or Path(sys.executable).parent).resolve()
    if superlink.bin_directory.resolve() != ours:
        return f"it runs another environment ({superlink.bin_directory}, not {ours})", False
    home = os.environ.get("FLWR_HOME")
    if home and superlink.flwr_home and Path(superlink.flwr_home).resolve() != Path(home).resolve():
        return f"it serves another Flower home ({superlink.flwr_home}, not {home})", False
    return None


def end(superlink: ManagedSuperLink, timeout: float = 15.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; True once the process is gone (its SuperExec
    follows it: it watches its parent's pid)."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(superlink.pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not Path(f"/proc/{superlink.pid}").exists() or _zombie(superlink.pid):
                return True
            time.sleep(0.1)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def task_start_error(superlink: ManagedSuperLink, timeout: float = 120.0) -> str | None:
    """What stops a run's task from starting under ``superlink``, found by starting as it does: the
    task (``flwr-simulation``, its output discarded by the SuperExec) imports Flower's simulation,
    Ray and torch in the SuperLink's directory and environment. The last line of that import's
    error; None if it imports."""
    if superlink.gone_directory:
        return f"the local SuperLink's directory, {superlink.gone_directory}, is gone"
    python = superlink.bin_directory / "python"
    try:
        probe = subprocess.run([str(python), "-c", "import flwr.simulation.app, ray, torch"], cwd=superlink.directory,
                               env=_environ(superlink.pid), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the task's first imports take over {timeout:.0f} s"
    except OSError as error:
        return f"the local SuperLink's Python cannot start: {error}"
    lines = [line for line in probe.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if probe.returncode and lines else None


def _environ(pid: int) -> dict[str, str] | None:
    try:
        return dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
                    .split("\0") if "=" in v)
    except OSError:
        return None


def check() -> str | None:
    """The local SuperLink on this environment's port: a stale one is ended and said so on stderr;
    None when a run can go ahead, else the one line that says why not."""
    superlink = find()
    found = superlink and problem(superlink)
    if not found:
        return None
    reason, stale = found
    where = f"the local SuperLink on 127.0.0.1:{http_port()} (pid {superlink.pid})"
    if stale and end(superlink):
        print(f"protofl: ended {where}: {reason}; `flwr run` starts a new one", file=sys.stderr)
        return None
    return (f"{where} cannot run this environment's app: {reason}. End it with `kill {superlink.pid}` "
            "(or set FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and FLWR_LOCAL_CONTROL_API_PORT to free ports)")


if __name__ == "__main__":  # ./setup.sh: end a stale SuperLink on this checkout's ports; report another's
    refusal = check()
    if refusal:
        print(f"protofl: {refusal}", file=sys.stderr)
