"""`flwr run .` and `protofl run .` end to end, in a subprocess with its own Flower home and ports."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from native import (SUPERLINK_LIMIT, free_port, kill_trees, missed_startup_limits, pids_with_argument,
                    start_local_superlink, start_managed_superlink, wait_for_port)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def flwr_command(tmp_path, run_config, name="e2e", runner="flwr"):
    """(command, environment) of `flwr run . --stream` (or ``runner="protofl"``: `protofl run`) with
    ``run_config``, its own Flower home (``tmp_path/flwr-home``, which names every process it starts)
    and ports."""
    bin_dir = Path(sys.executable).parent  # flwr spawns flower-superlink etc. from PATH
    env = os.environ | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    command = [
        str(bin_dir / runner), "run", str(ROOT), "--stream",
        "--run-config", f"{run_config} output-dir='{tmp_path}' run-name='{name}'",
        "--federation-config", "num-supernodes=3 client-resources-num-cpus=1",
    ]
    return command, env


def flwr_run(tmp_path, run_config, name="e2e", extra_env=None, runs=1, runner="flwr"):
    """`flwr run . --stream` (or `protofl run`) with ``run_config`` (and ``extra_env``), ``runs``
    times on one local SuperLink: the finished process (output captured), or with ``runs`` > 1
    (the finished processes, and what `flwr ls --format json` printed after them). A run that missed
    Flower's start of the SuperLink runs again on one started and waited for."""
    command, env = flwr_command(tmp_path, run_config, name, runner)
    env |= extra_env or {}
    home = env["FLWR_HOME"]
    try:
        done = []
        for _ in range(runs):
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
            if run.returncode and SUPERLINK_LIMIT in run.stdout + run.stderr:  # `flwr run` on a loaded host
                start_local_superlink(Path(sys.executable).parent, env, Path.cwd(), timeout=300)
                run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
            done.append(run)
        if runs > 1:
            flwr = str(Path(sys.executable).parent / "flwr")
            listed = subprocess.run([flwr, "ls", "--format", "json"], env=env, capture_output=True, text=True,
                                    timeout=60, check=True)
            return done, listed.stdout
    finally:
        kill_trees(pids_with_argument(home))  # the managed SuperLink and what it started
    assert not pids_with_argument(home)
    return done[0]


def test_a_diverged_run_and_a_refused_start_end_failed_with_one_line_and_no_traceback(tmp_path):
    """The second run asks for the first one's run directory without resume=true: refused at its
    start. Both end failed in `flwr ls`, each with its one line as the reason; `protofl run` exits
    1 for each, its last line that reason, and the check that docs/user-guide/running.md gives
    scripts fails."""
    (diverged, refused), listed = flwr_run(tmp_path, "method='fedavg' num-server-rounds=3 lr=1e12", runs=2,
                                           runner="protofl")
    results = json.loads((tmp_path / "e2e" / "results.json").read_text())
    assert results["stopped"].startswith("round 1: 0 of 3 client updates usable")
    assert diverged.returncode == 1 and re.fullmatch(
        rf"protofl run: run \d+ finished:failed: {re.escape(results['stopped'])}", diverged.stdout.splitlines()[-1])
    assert refused.returncode == 1 and "resume=true continues it" in refused.stdout.splitlines()[-1]
    assert f"protofl: the run stopped. {results['stopped']}" in diverged.stdout
    assert f"results written to {tmp_path / 'e2e'}" in diverged.stdout
    assert "protofl: the run cannot start. " in refused.stdout and "resume=true continues it" in refused.stdout
    for run in (diverged, refused):
        assert "Traceback" not in run.stdout + run.stderr
    by_start = sorted(json.loads(listed)["runs"], key=lambda run: run["pending-at"])
    assert [run["status"] for run in by_start] == ["finished:failed"] * 2, by_start
    assert results["stopped"] in by_start[0]["status-details"]
    assert "resume=true continues it" in by_start[1]["status-details"]
    check = re.search(r"\| python3 -c '\n(.*?)'\n", (ROOT / "docs" / "user-guide" / "running.md").read_text(), re.S)
    scripted = subprocess.run([sys.executable, "-c", check.group(1)], input=listed, capture_output=True, text=True)
    assert scripted.returncode == 1 and scripted.stdout.startswith("finished:failed"), scripted


def test_two_checkouts_run_at_once_each_on_its_own_superlink_with_its_own_code(tmp_path):
    """Two copies of the project side by side, each with the environment ``./setup.sh`` gives its
    checkout (its own FLWR_HOME, its own ports from ``./setup.sh --ports``) and a ServerApp that
    says which copy it is: ``flwr run . --stream`` in both at once. Each run went to a local
    SuperLink of its own and ran its own copy's code. A run that missed a startup limit (native.py)
    on a loaded host has not begun: both run at once again, its SuperLink started and waited for."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bin_dir = Path(sys.executable).parent
    commands, envs = {}, {}
    for name in ("one", "two"):
        checkout = tmp_path / name
        for path in tracked:
            if (ROOT / path).is_file():
                (checkout / path).parent.mkdir(parents=True, exist_ok=True)
                (checkout / path).write_bytes((ROOT / path).read_bytes())
        with (checkout / "protofl" / "server_app.py").open("a") as module:
            module.write(f'\nprint("protofl checkout: {name}, run from", __file__, flush=True)\n')
        ports = subprocess.run(["bash", "setup.sh", "--ports"], cwd=checkout, capture_output=True, text=True,
                               check=True).stdout.split()
        envs[name] = os.environ | dict(pair.split("=") for pair in ports) | {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLWR_HOME": str(checkout / ".flwr"),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
        commands[name] = [str(bin_dir / "flwr"), "run", ".", "--stream", "--run-config",
                          f"num-server-rounds=1 output-dir='{tmp_path / 'runs'}' run-name='{name}'",
                          "--federation-config", "num-supernodes=2 client-resources-num-cpus=1"]
    started = []

    def run_both() -> dict[str, tuple[int, str]]:
        """Both checkouts' `flwr run` at once: (exit status, output) of each."""
        running = {name: subprocess.Popen(command, cwd=tmp_path / name, env=envs[name], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True) for name, command in commands.items()}
        started.extend(running.values())
        output = {name: process.communicate(timeout=400)[0] for name, process in running.items()}
        return {name: (process.returncode, output[name]) for name, process in running.items()}

    try:
        done = run_both()
        missed = {name: missed_startup_limits(output) for name, (code, output) in done.items() if code}
        if missed and all(missed.values()):  # each failed run stopped at the host's load, before it began
            print(f"missed a startup limit: {missed}; running both again")
            for name, limits in missed.items():
                if SUPERLINK_LIMIT in limits:
                    start_local_superlink(bin_dir, envs[name], tmp_path / name, timeout=300)
            shutil.rmtree(tmp_path / "runs", ignore_errors=True)
            done = run_both()
    finally:
        for process in started:
            process.kill()
        for name in commands:
            kill_trees(pids_with_argument(str(tmp_path / name / ".flwr")))
    for name, other in (("one", "two"), ("two", "one")):
        code, output = done[name]
        assert code == 0, output
        # the app runs where the SuperLink that took it keeps its apps: under that checkout's FLWR_HOME
        assert f"protofl checkout: {name}, run from {tmp_path / name / '.flwr' / 'apps'}" in output, output
        assert f"protofl checkout: {other}" not in output
        assert json.loads((tmp_path / "runs" / name / "results.json").read_text())["rounds"]
    assert not pids_with_argument(str(tmp_path))


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_protofl_run_ends_a_stale_superlink_completes_on_busy_cores_and_ctrl_c_stops_its_run(tmp_path):
    """A managed SuperLink on this Flower home's port, started as `flwr run` starts one, from a
    directory then deleted (a checkout removed and cloned again at its path): every run it takes
    dies at `import torch` before its first heartbeat (tests/test_run_command.py). With every core
    busy (a busy loop on each the load leaves idle), `protofl run` ends that SuperLink, says so, and
    its two rounds on a new one either complete (exit 0) or fail with one last line naming the status
    and cause. Then Ctrl-C in a long run after its first round: `protofl run` exits 130 and the
    SuperLink has the run stopped."""
    command, env = flwr_command(tmp_path, "method='fedavg' num-server-rounds=2", runner="protofl")
    home, gone = Path(env["FLWR_HOME"]), tmp_path / "old-checkout"
    gone.mkdir()
    port, bin_dir = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], Path(sys.executable).parent
    stale = start_managed_superlink(bin_dir, env, cwd=gone)  # as flwr.cli.local_superlink starts one
    try:
        wait_for_port("127.0.0.1", int(port), timeout=60)
        gone.rmdir()
        # a busy loop for each core the load leaves idle: beside CI's other sessions the cores are busy
        # already, and loops there would only take their time
        idle = max(0, os.cpu_count() - round(os.getloadavg()[0]))
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(idle)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
        finally:
            for process in busy:
                process.kill()
                process.wait()
        assert stale.wait(timeout=30) is not None
        assert (f"protofl: ended the local SuperLink on 127.0.0.1:{port} (pid {stale.pid}): the directory it was "
                f"started from, {gone}, is gone") in done.stderr, done.stderr
        last = last_line(done.stdout)
        completed = done.returncode == 0 and re.fullmatch(r"protofl run: run \d+ finished:completed", last)
        failed = done.returncode == 1 and re.fullmatch(r"protofl run: run \d+ finished:failed: \S.*", last)
        assert completed or failed, done.stdout[-3000:]
        if done.returncode:
            pytest.xfail(f"the busy run failed, with its cause: {last}")

        long_command, _ = flwr_command(tmp_path, "method='fedavg' num-server-rounds=200", "long", "protofl")
        # Ctrl-C's SIGINT as a terminal's foreground command gets it (a shell's background job, which
        # CI may be, starts its commands with SIGINT ignored)
        long = subprocess.Popen(long_command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        output = ""
        deadline = time.monotonic() + 300
        while "round 1: GM" not in output and time.monotonic() < deadline and long.poll() is None:
            output += long.stdout.readline()
        long.send_signal(signal.SIGINT)
        output += long.communicate(timeout=180)[0]
        run_id = re.search(r"Successfully started run (\d+)", output).group(1)
        assert long.returncode == 130, output[-3000:]
        assert last_line(output) == f"protofl run: stopped run {run_id} (interrupted)", output[-3000:]
        listed = subprocess.run([str(bin_dir / "flwr"), "ls", "--run-id", run_id, "--format", "json"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert json.loads(listed.stdout)["runs"][0]["status"] == "finished:stopped", listed.stdout
        assert 1 <= len(json.loads((tmp_path / "long" / "results.json").read_text())["rounds"]) < 200
    finally:
        kill_trees([stale.pid, *pids_with_argument(str(home))])
    assert not pids_with_argument(str(home))
