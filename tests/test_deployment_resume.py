"""A real loopback deployment (docker-compose.yml's command lines, its two SuperNodes, none with a
``state-dir``: each ClientApp keeps its state under its Flower home, the deployment default) loses
its ServerApp and one SuperNode in round 3 of 4; the SuperNode is restarted,
`flwr run ... resume=true` finishes the run, and every round equals the same run made without
faults (in one process, with the nodes' one torch thread: the numbers are the same)."""

import os
import re
import signal
from pathlib import Path

import native
import pytest
import torch
from inprocess import run_in_process
from native import children_of, kill_trees
from test_resume import assert_same_rounds, wait_for_round

from protofl.federation.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

RUN = {"method": "fedproto", "num-server-rounds": 4, "local-epochs": 1, "checkpoint-every": 2,
       "global-test-pm-per-class": 10, "min-fit-clients": 2}
NUM_NODES = 2
KILLED_NODE = 2  # supernode-2, partition 1


@pytest.fixture
def deployment(tmp_path):
    started = native.NativeDeployment(tmp_path / "services", native.environment())
    yield started
    started.stop()


def compose_without_state_dirs() -> dict:
    """The compose demo's command lines without their state-dir: the deployment default."""
    compose = native.load_compose()
    for i in range(1, NUM_NODES + 1):
        command = compose["services"][f"supernode-{i}"]["command"]
        at = command.index("--node-config") + 1
        command[at] = re.sub(r'\s*state-dir="[^"]*"', "", command[at])
        assert "state-dir" not in command[at]
    return compose


def test_a_run_whose_serverapp_and_one_supernode_die_resumes_to_the_same_results(tmp_path, deployment):
    compose = compose_without_state_dirs()
    link = ("127.0.0.1", native.free_port())
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    addresses = native.start_federation(deployment, compose, link, nodes)
    home = native.cli_home(tmp_path / "cli-home", f"{link[0]}:{link[1]}")
    config = (f"method='fedproto' num-server-rounds=4 local-epochs=1 checkpoint-every=2 global-test-pm-per-class=10 "
              f"min-fit-clients=2 output-dir='{tmp_path}' run-name='killed'")  # RUN, as flwr run takes it
    submitted = native.flwr(home, ["run", str(ROOT), "deployment", "--run-config", config], timeout=120)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]

    wait_for_round(tmp_path / "killed", 3, None, timeout=400)
    serverapp = deployment.processes["superexec-serverapp"].pid
    children = children_of(serverapp)
    node, clientapp = f"supernode-{KILLED_NODE}", f"superexec-clientapp-{KILLED_NODE}"
    kill_trees([*children, deployment.processes[node].pid, deployment.processes[clientapp].pid],
               signals=(signal.SIGKILL,))  # the ServerApp (not its SuperExec), the node and its ClientApps
    assert children and Checkpoint.load(tmp_path / "killed").server_round == 2
    default = deployment.workdir / clientapp / "flwr-home" / "protofl-state"  # its $FLWR_HOME's
    assert os.stat(default).st_mode & 0o777 == 0o700
    assert any((default / "killed" / f"partition-{KILLED_NODE - 1}").glob("round-*.state"))  # what it continues from
    assert not (tmp_path / "killed" / "client-state").exists()  # not the server's disk: a deployment
    for name in (node, clientapp):
        host, port = (nodes[KILLED_NODE - 1][0], nodes[KILLED_NODE - 1][1]) if name == node else ("127.0.0.1", None)
        deployment.start(name, native.service_command(compose, name, host, port, addresses), None,
                         native.service_environment(compose, name))

    resumed = native.protofl_run(home, [str(ROOT), "deployment", "--run-config", config + " resume=true"],
                                 timeout=500)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resuming" in output, output[-4000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the nodes (num-threads=1)
    try:
        run_in_process(RUN | {"output-dir": str(tmp_path), "run-name": "whole"}, num_nodes=NUM_NODES)
    finally:
        torch.set_num_threads(threads)
    assert_same_rounds(tmp_path / "killed", tmp_path / "whole")
