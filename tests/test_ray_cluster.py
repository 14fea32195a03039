"""A simulation on a Ray cluster of two nodes, joined as docs/deployment/ray-cluster.md says: a head
on this machine and a worker in mount and UTS namespaces of its own (its own hostname, and its own
disk where the runs' directories are: another machine that mounts the code at the same path but
not the head's disk). Each node offers one CPU, so the ClientApps run on both.

The clients' state in the run directory (the default) is not on the worker's disk: the run stops in
round 1, naming the directory and the worker. A state dir both nodes see, and ``state-dir=memory``
(the state travels in Flower's context), give the same rounds as the same federation in one process;
so does FedAvg, which keeps no state. The runs take both Flower fronts (``flower-api``): protofl's
ServerApp and ClientApp, as the SuperExec loads them."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from flwr.simulation import run_simulation
from inprocess import run_in_process
from native import kill_trees, pids_with_argument

from protofl.client_app import PrototypeClientApp
from protofl.server_app import PrototypeServerApp, RunFailed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare"),
]
WORKER = "protofl-ray-worker"
COMPARED = ("clients", "train_loss", "global_accuracy", "personalized_accuracy", "personalized_std")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(the head's address, the directory only the head sees)."""
    head_only = tmp_path_factory.mktemp("head-only")
    # Ray's sockets live under its temp dir: a short path of its own (and not /tmp/ray, where a
    # later ray.init() of another test would find this cluster)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    address = f"127.0.0.1:{free_port()}"
    ray = str(Path(sys.executable).parent / "ray")
    common = ["--num-cpus=1", "--block", "--disable-usage-stats"]
    started = [subprocess.Popen([ray, "start", "--head", f"--port={address.split(':')[1]}", f"--temp-dir={temp_dir}",
                                 "--include-dashboard=false", *common], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    try:
        wait_for_nodes(ray, address, 1)
        started.append(subprocess.Popen(
            ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
             f'hostname {WORKER} && mount -t tmpfs tmpfs "$1" && shift && exec "$@"', "sh", str(head_only),
             ray, "start", f"--address={address}", *common], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        wait_for_nodes(ray, address, 2)
        yield address, head_only
    finally:
        kill_trees([p.pid for p in started] + pids_with_argument(temp_dir) + pids_with_argument(address))
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_nodes(ray: str, address: str, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = subprocess.run([ray, "status", f"--address={address}"], capture_output=True, text=True)
        if status.stdout.count(" node_") == count:
            return
        time.sleep(1)
    raise AssertionError(f"the Ray cluster at {address} did not reach {count} nodes in {timeout:.0f} s")


def run_config(directory: Path, name: str, method: str, front: str = "message", **overrides) -> dict:
    return {"method": method, "dataset": "digits", "num-server-rounds": 2, "output-dir": str(directory),
            "run-name": name, "flower-api": front} | overrides


def on_cluster(address: str, config: dict) -> dict:
    """The run of ``config`` on the cluster, its ServerApp here with one torch thread as the run in
    one process has (FedSA's server sums depend on the thread count; each Ray worker has one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_simulation(
            PrototypeServerApp(config), PrototypeClientApp(config), num_supernodes=3,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"address": address}},
        )
    finally:
        torch.set_num_threads(threads)
    return json.loads((Path(config["output-dir"]) / config["run-name"] / "results.json").read_text())


def test_state_in_the_head_only_run_directory_stops_the_run_naming_the_worker(cluster):
    address, head_only = cluster
    config = run_config(head_only, "default", "fedproto", **{"num-server-rounds": 1})
    with pytest.raises(RunFailed):  # a failed run, its one line in its results
        on_cluster(address, config)
    results = json.loads((head_only / "default" / "results.json").read_text())
    assert results["stopped"].startswith(
        f"round 1: state-dir {head_only / 'default' / 'client-state'} is not shared with the ServerApp: "
        f"the ClientApp on {WORKER} does not see the marker")
    assert "\n" not in results["stopped"]


@pytest.mark.parametrize("method, state_dir, front", [("fedproto", "shared", "message"), ("fedsa", "memory", "legacy"),
                                                      ("fedavg", "", "message")])
def test_runs_on_both_nodes_equal_the_same_federation_in_one_process(cluster, tmp_path, method, state_dir, front):
    address, head_only = cluster
    overrides = {"state-dir": str(tmp_path / "state") if state_dir == "shared" else state_dir}
    results = on_cluster(address, run_config(head_only, method, method, front, **overrides))
    assert "stopped" not in results
    assert {c["host"] for c in results["client_compute"].values()} == {socket.gethostname(), WORKER}
    run_in_process(run_config(tmp_path, "one-process", method, front, **overrides))
    alone = json.loads((tmp_path / "one-process" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for there, here in zip(results["rounds"], alone["rounds"], strict=True):
        assert {k: there[k] for k in COMPARED} == {k: here[k] for k in COMPARED}
