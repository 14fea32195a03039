"""``protofl run``: `flwr run --stream`, whose exit status is the run's.

Flower's CLI exits 0 whatever becomes of the run it started. ``protofl run`` takes `flwr run`'s
arguments, streams the same output, then asks the SuperLink for the run's final status:

- exit 0 only for ``finished:completed`` with at least one round line on the stream;
- otherwise 1, with one last line naming the status and the cause (the run's results.json
  ``stopped``, or the SuperLink's details and the stream's first error line, or what the stream
  lacked);
- Ctrl-C stops the run on the SuperLink (`flwr stop`) and exits 130.

Before a run on the managed local SuperLink (a ``:local:`` connection) it checks that SuperLink
(:mod:`protofl.local_superlink`): a stale one is ended, another environment's refused. Where none
answers, it starts one as `flwr run` would, but waits up to :data:`SUPERLINK_PATIENCE` seconds for
it, where `flwr run` gives up after 15 s (in a CI whose two cores ran three test sessions and a
docker build, it did).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Mapping, Sequence

from protofl import flower_compat, local_superlink

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED = re.compile(r"Successfully started run (\d+)")
ROUND_LINE = re.compile(r"\bround \d+: .*\bup [\d.]+ MB, down [\d.]+ MB \| [\d.]+ s\s*$")  # report.progress_line
RUN_DIRECTORY = re.compile(r"results (?:go to|written to) (\S.*?)\s*$")
# a traceback's error line, as Python writes it (unindented): the first one on the stream is where a
# failed simulation's trouble began (Flower's details name only its own wrapper, "An error was
# encountered. Ending simulation.", where the first is e.g. Ray's node that did not start in time)
STREAM_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S.*$")
COMPLETED = "finished:completed"
SUPERLINK_PATIENCE = 180.0  # seconds a managed local SuperLink may take to answer
INTERRUPTED = 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="protofl run", description="`flwr run APP [SUPERLINK] --stream`, then exit with the run's status: "
        "0 only when it finished completed.")
    p.add_argument("app", nargs="?", default=".", help="the app directory (default: .)")
    p.add_argument("superlink", nargs="?", help="the SuperLink connection (default: the Flower config's)")
    p.add_argument("--federation")
    p.add_argument("-c", "--run-config", action="append", default=[])
    p.add_argument("--federation-config", action="append", default=[])
    p.add_argument("--stream", action="store_true", help="accepted; the output is always streamed")
    return p


def flwr_executable() -> str:
    candidate = Path(sys.executable).parent / "flwr"
    return str(candidate) if candidate.exists() else "flwr"


def flwr_run_command(args: argparse.Namespace) -> list[str]:
    command = [flwr_executable(), "run", args.app] + ([args.superlink] if args.superlink else [])
    command += ["--federation", args.federation] if args.federation else []
    for value in args.run_config:
        command += ["--run-config", value]
    for value in args.federation_config:
        command += ["--federation-config", value]
    return command + ["--stream"]


def connection_address(superlink: str | None) -> str | None:
    """The address of the SuperLink connection ``superlink`` (default: the config's default) in
    the Flower config (``$FLWR_HOME/config.toml``; where there is none, `flwr` writes its default,
    whose default connection is the local SuperLink), if it names one."""
    home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    try:
        text = (home / "config.toml").read_text()
    except FileNotFoundError:
        text = '[superlink]\ndefault = "local"\n[superlink.local]\naddress = ":local:"\n'
    except OSError:
        return None
    try:
        config = tomllib.loads(text).get("superlink", {})
    except tomllib.TOMLDecodeError:
        return None
    name = superlink or config.get("default")
    entry = config.get(name) if isinstance(name, str) else None
    return entry.get("address") if isinstance(entry, dict) else None


def final_status(run_id: str, superlink: str | None, timeout: float = 60.0) -> tuple[str, str]:
    """(status, details) of ``run_id`` from `flwr ls`, once it is finished (or ``timeout`` passed)."""
    command = [flwr_executable(), "ls"] + ([superlink] if superlink else []) + ["--run-id", run_id, "--format", "json"]
    deadline = time.monotonic() + timeout
    status, details = "unknown", "the SuperLink did not say"
    while True:
        try:
            listed = subprocess.run(command, capture_output=True, text=True, timeout=30)
            runs = json.loads(listed.stdout).get("runs") or []
            if runs:
                status, details = runs[0].get("status", status), runs[0].get("status-details", details)
        except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError, AttributeError):
            pass
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def stopped_reason(run_directory: str | None) -> str | None:
    """results.json's ``stopped``, if the run wrote one."""
    try:
        return json.loads((Path(run_directory) / "results.json").read_text()).get("stopped") if run_directory else None
    except (OSError, ValueError, AttributeError):
        return None


def verdict(run_id: str | None, status: str, details: str, rounds: int, run_directory: str | None,
            start_error: str | None = None, stream_error: str | None = None) -> tuple[int, str]:
    """(exit code, the last line) of a run from what the stream and the SuperLink said (the stream's
    first error line, ``stream_error``, beside the SuperLink's details), and for a task that never
    reported, what stops it from starting (``start_error``)."""
    if run_id is None:
        return 1, "protofl run: no run was started (see `flwr run`'s output above)"
    if status == COMPLETED and rounds:
        return 0, f"protofl run: run {run_id} {status}"
    if status == COMPLETED:
        cause = "its stream ended without a round line"
    else:
        cause = stopped_reason(run_directory)
        if cause is None:
            cause = (details if details not in ("", "N/A") else None) or (
                "no cause recorded" if rounds else "its stream ended without a round line")
            if stream_error and stream_error.split(": ", 1)[1] not in cause:  # its message, not its name
                cause += f" (the stream's first error: {stream_error})"
    if "No heartbeat" in cause:
        cause += f": its task died before it started ({start_error or 'its output is discarded by the SuperExec'})"
    return 1, f"protofl run: run {run_id} {status}: {cause}"


def stop(process: subprocess.Popen, run_id: str | None, superlink: str | None) -> None:
    """After Ctrl-C: `flwr run` interrupted, its last lines still copied (a full pipe would block
    it), and the run stopped on the SuperLink."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
    copy = threading.Thread(target=lambda: [sys.stdout.write(line) for line in process.stdout], daemon=True)
    copy.start()
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    if run_id is not None:
        try:
            subprocess.run([flwr_executable(), "stop", run_id] + ([superlink] if superlink else []),
                           capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    copy.join(timeout=5)
    sys.stdout.flush()


def flwr_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`flwr run`'s environment: this Python's scripts first on the PATH, and Ray's workers at the
    shell's priority (``RAY_worker_niceness=0`` unless set): a managed local SuperLink that `flwr run`
    starts inherits it, and at Ray's default niceness of 15 its simulations' ClientApps get only the
    CPU other processes leave (on a busy machine every one timed out at discovery)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    return {"RAY_worker_niceness": "0"} | dict(environ) | {"PATH": path}


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    os.environ.update(flwr_environment(os.environ))  # `flwr run`'s, and a SuperLink's started here
    address = connection_address(args.superlink)
    local = address in (":local:", ":local-in-memory:")
    if local:
        refusal = local_superlink.check() or flower_compat.start_local_superlink(
            address == ":local-in-memory:", SUPERLINK_PATIENCE)
        if refusal:
            print(f"protofl run: {refusal}", flush=True)
            return 1
    process = subprocess.Popen(flwr_run_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", bufsize=1)
    run_id, rounds, run_directory, stream_error = None, 0, None, None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            plain = ANSI.sub("", line)
            if run_id is None and (started := STARTED.search(plain)):
                run_id = started.group(1)
            rounds += bool(ROUND_LINE.search(plain))
            if found := RUN_DIRECTORY.search(plain):
                run_directory = found.group(1)
            if stream_error is None and (error := STREAM_ERROR.match(plain.rstrip())):
                stream_error = error.group(0)
        process.wait()
        status, details = final_status(run_id, args.superlink) if run_id is not None else ("", "")
    except KeyboardInterrupt:
        stop(process, run_id, args.superlink)
        print(f"protofl run: stopped{f' run {run_id}' if run_id else ''} (interrupted)", flush=True)
        return INTERRUPTED
    start_error = None
    if local and "No heartbeat" in details and (superlink := local_superlink.find()):
        start_error = local_superlink.task_start_error(superlink)
    code, last = verdict(run_id, status, details, rounds, run_directory, start_error, stream_error)
    print(last, flush=True)
    return code
