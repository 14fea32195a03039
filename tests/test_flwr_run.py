"""`flwr run .` end to end, in a subprocess with its own Flower home and ports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from native import free_port, kill_trees, pids_with_argument

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def flwr_command(tmp_path, run_config, name="e2e"):
    """(command, environment) of `flwr run . --stream` with ``run_config``, its own Flower home
    (``tmp_path/flwr-home``, which names every process it starts) and ports."""
    bin_dir = Path(sys.executable).parent  # flwr spawns flower-superlink etc. from PATH
    env = os.environ | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    command = [
        str(bin_dir / "flwr"), "run", str(ROOT), "--stream",
        "--run-config", f"{run_config} output-dir='{tmp_path}' run-name='{name}'",
        "--federation-config", "num-supernodes=3 client-resources-num-cpus=1",
    ]
    return command, env


def flwr_run(tmp_path, run_config, name="e2e", extra_env=None):
    """`flwr run . --stream` with ``run_config`` (and ``extra_env``); the finished process (output captured)."""
    command, env = flwr_command(tmp_path, run_config, name)
    env |= extra_env or {}
    home = env["FLWR_HOME"]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    finally:
        kill_trees(pids_with_argument(home))  # the managed SuperLink and what it started
    assert not pids_with_argument(home)
    return run


def test_flwr_run_fedproto_two_rounds(tmp_path):
    run = flwr_run(tmp_path, "method='fedproto' num-server-rounds=2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"results written to {tmp_path / 'e2e'}" in run.stdout
    results = json.loads((tmp_path / "e2e" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert results["run_config"]["method"] == "fedproto"
    assert results["rounds"][1]["bytes_down"] > 0  # global prototypes went out in round 2
    assert results["rounds"][1]["personalized_accuracy"] > 0.5


def test_a_diverged_run_ends_with_one_line_and_no_traceback(tmp_path):
    run = flwr_run(tmp_path, "method='fedavg' num-server-rounds=3 lr=1e12")
    results = json.loads((tmp_path / "e2e" / "results.json").read_text())
    assert results["stopped"].startswith("round 1: 0 of 3 client updates usable")
    assert f"protofl: the run stopped. {results['stopped']}" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    assert f"results written to {tmp_path / 'e2e'}" in run.stdout
