"""`protofl run`'s verdict on a run, and the managed local SuperLink's checks (protofl/run_command.py,
protofl/local_superlink.py); whole runs through `protofl run` are in tests/test_flwr_run.py."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protofl import local_superlink, run_command
from protofl.local_superlink import ManagedSuperLink
from protofl.report import progress_line

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("record", [
    {"global_accuracy": 0.9, "personalized_accuracy": 0.8, "personalized_std": 0.1, "train_loss": 0.3,
     "bytes_up": 2.5e6, "bytes_down": 1e6, "seconds": 3.25},
    {"bytes_up": 0, "bytes_down": 0, "seconds": 0.0},  # a round that measured nothing is still a round
])
def test_a_round_line_is_what_the_server_logs_for_a_round(record):
    logged = f"\x1b[92mINFO \x1b[0m:      round 12: {progress_line(record)}\n"
    assert run_command.ROUND_LINE.search(run_command.ANSI.sub("", logged))
    for other in ("round 1: training partitions [0, 1, 2]", "round 1: dropped the fit result of node 7: up 1 MB"):
        assert not run_command.ROUND_LINE.search(other)


def test_exit_zero_only_for_a_completed_run_that_streamed_a_round(tmp_path):
    assert run_command.verdict("7", "finished:completed", "N/A", 3, None) == (0, "protofl run: run 7 finished:completed")
    code, line = run_command.verdict("7", "finished:completed", "N/A", 0, None)
    assert code == 1 and line.endswith("finished:completed: its stream ended without a round line")
    assert run_command.verdict(None, "", "", 0, None)[0] == 1
    assert run_command.verdict("7", "running", "", 2, None)[0] == 1  # never seen to finish


def test_flwr_runs_with_this_pythons_scripts_and_ray_workers_at_the_shells_priority():
    env = run_command.flwr_environment({"PATH": "/usr/bin", "HOME": "/h"})
    assert env["PATH"] == f"{BIN}{os.pathsep}/usr/bin" and env["HOME"] == "/h"
    assert env["RAY_worker_niceness"] == "0"  # Ray's default, 15, starved the ClientApps on a busy machine
    assert run_command.flwr_environment({"RAY_worker_niceness": "10"})["RAY_worker_niceness"] == "10"


def test_the_cause_is_results_json_then_the_superlinks_details_then_what_the_stream_lacked(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"stopped": "round 1: 0 of 3 client updates usable"}))
    assert run_command.verdict("7", "finished:failed", "Simulation failed", 0, str(tmp_path)) == (
        1, "protofl run: run 7 finished:failed: round 1: 0 of 3 client updates usable")
    assert run_command.verdict("7", "finished:failed", "Simulation failed with exception: x", 1, None)[1].endswith(
        "finished:failed: Simulation failed with exception: x")
    assert run_command.verdict("7", "finished:stopped", "N/A", 0, None)[1].endswith(
        "finished:stopped: its stream ended without a round line")
    code, line = run_command.verdict("7", "finished:failed", "No heartbeat received from the task", 0, None,
                                     "ModuleNotFoundError: No module named 'ray'")
    assert code == 1 and line.endswith("its task died before it started (ModuleNotFoundError: No module named 'ray')")


# from the CI of 1b1feac: the wheel test's `protofl run`, its stream's lines that matter
RAY_NODE_LATE = """\
INFO :      Starting simulation
ERROR :     Backend `ray`, failed to raise: The current node timed out during startup.
Traceback (most recent call last):
  File ".venv/lib/python3.11/site-packages/ray/_private/node.py", line 423, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the raylet failed to startup or the GCS has become overloaded.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
    raise RuntimeError("Simulation Runtime crashed.") from ex
RuntimeError: Simulation Runtime crashed.
"""


def test_a_failed_runs_cause_names_the_streams_first_error_where_the_superlinks_details_do_not():
    errors = [line for line in RAY_NODE_LATE.splitlines() if run_command.STREAM_ERROR.match(line)]
    assert errors[0].startswith("Exception: The current node timed out") and len(errors) == 2
    details = "Simulation failed with exception: An error was encountered. Ending simulation."
    code, line = run_command.verdict("7", "finished:failed", details, 0, None, stream_error=errors[0])
    assert code == 1 and line == f"protofl run: run 7 finished:failed: {details} (the stream's first error: {errors[0]})"
    # where the details already say it (Flower's for a ServerApp's own exception: its message), nothing is added
    raised = "ValueError: model must be one of ['cnn'], got 'x'"
    details = "Simulation failed with exception: model must be one of ['cnn'], got 'x'"
    assert run_command.verdict("7", "finished:failed", details, 0, None, stream_error=raised)[1].endswith(
        f"finished:failed: {details}")
    assert run_command.verdict("7", "finished:completed", "N/A", 2, None, stream_error=errors[0]) == (
        0, "protofl run: run 7 finished:completed")


def test_the_connection_address_is_the_flower_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert run_command.connection_address(None) == ":local:"  # no config.toml: flwr writes its default
    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "local"\n[superlink.local]\naddress = ":local:"\n'
                                          '[superlink.deployment]\naddress = "10.0.0.1:9093"\n')
    assert run_command.connection_address(None) == ":local:"
    assert run_command.connection_address("deployment") == "10.0.0.1:9093"
    assert run_command.connection_address("absent") is None


def superlink(directory, bin_directory, home="/nonexistent-home"):
    return ManagedSuperLink(1, ["python", str(Path(bin_directory) / "flower-superlink"), "--port", "9",
                                "--database", f"{home}/local-superlink/state.db"], str(directory), home)


def test_a_superlink_whose_directory_environment_or_home_is_gone_is_stale(tmp_path, monkeypatch):
    monkeypatch.delenv("FLWR_HOME", raising=False)
    home = tmp_path / "home"
    (home / "local-superlink").mkdir(parents=True)
    assert local_superlink.problem(superlink(tmp_path, BIN, home), BIN) is None
    reason, stale = local_superlink.problem(superlink(f"{tmp_path}/gone (deleted)", BIN, home), BIN)
    assert stale and reason == f"the directory it was started from, {tmp_path}/gone, is gone"
    assert local_superlink.problem(superlink(tmp_path, BIN, tmp_path / "gone"), BIN)[1]
    assert local_superlink.problem(superlink(tmp_path, tmp_path / "old-venv" / "bin", home), BIN)[1]
    other = tmp_path / "other-venv" / "bin"
    other.mkdir(parents=True)
    reason, stale = local_superlink.problem(superlink(tmp_path, other, home), BIN)
    assert not stale and reason.startswith("it runs another environment")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "mine"))
    reason, stale = local_superlink.problem(superlink(tmp_path, BIN, home), BIN)
    assert not stale and reason.startswith("it serves another Flower home")


def test_a_task_started_in_a_deleted_directory_dies_at_import_torch():
    """Why a stale SuperLink's runs die: its task starts in the SuperLink's directory, and there
    `import torch` ends the process (oneMKL: "Cannot load .../libtorch_cpu.so", exit code 2) with
    no Python exception, so the task never says why."""
    code = ("import os, tempfile; gone = tempfile.mkdtemp(); os.chdir(gone); os.rmdir(gone); "
            "import torch; print('imported')")
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert started.returncode != 0 and "imported" not in started.stdout, started
    assert "Traceback" not in started.stderr


def test_a_stale_superlink_on_this_port_is_ended_and_another_environments_refused(tmp_path, monkeypatch):
    """A process that looks like a managed SuperLink (a ``flower-superlink`` script serving ``--port``)
    started in a directory that is then deleted: found by its port, ended, said so. One of another
    environment is left running, and the refusal says how to end it."""
    port = "25999"
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", port)
    monkeypatch.delenv("FLWR_HOME", raising=False)
    other_bin = tmp_path / "venv" / "bin"
    other_bin.mkdir(parents=True)
    (other_bin / "flower-superlink").write_text("import time\ntime.sleep(120)\n")
    started = []
    try:
        for name in ("gone", "kept"):
            (tmp_path / name).mkdir()
            started.append(subprocess.Popen([sys.executable, str(other_bin / "flower-superlink"), "--port", port],
                                            cwd=tmp_path / name))
            time.sleep(0.5)
            if name == "gone":
                os.rmdir(tmp_path / name)
                found = local_superlink.find()
                assert found.pid == started[0].pid and found.directory.endswith(" (deleted)")
                assert local_superlink.check() is None
                assert started[0].wait(timeout=20) is not None
        refusal = local_superlink.check()
        assert refusal.endswith(f"End it with `kill {started[1].pid}` (or set FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and "
                                "FLWR_LOCAL_CONTROL_API_PORT to free ports)") and "another environment" in refusal
        assert started[1].poll() is None
    finally:
        for process in started:
            process.kill()
            process.wait()
