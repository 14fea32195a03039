"""Real SuperLink, SuperNode and SuperExec processes, started with docker-compose.yml's own command
lines (deploy/compose_e2e.sh runs them in Docker), each in its own directory and Flower home: the
insecure federation and a 2-round SCAFFOLD run on it (clients that upload named arrays and keep
control variates, on the legacy Flower front), each SuperNode in a network namespace of its own on a
bridge the module creates and removes (on loopback where this machine cannot); and a federation
whose ClientApps cannot load their data. Every process is killed by process group. A FedProto run
across processes gives the rounds of the same run in one process: tests/test_edge.py (through the
edge, TLS and SuperNode authentication) and tests/test_deployment_resume.py (after its faults)
check it.
"""

import importlib.util
import json
import subprocess
import uuid
from pathlib import Path

import native
import pytest
import torch
from inprocess import run_in_process
from test_resume import assert_same_rounds

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

NUM_NODES = 2
RUN_TIMEOUT = 420


def _run(tmp_path, cli_home, name, method, extra=""):
    run_config = f"method='{method}' num-server-rounds=2 output-dir='{tmp_path}' run-name='{name}'{extra}"
    run = native.protofl_run(cli_home, [str(ROOT), "deployment", "--run-config", run_config], timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]  # a remote run that completed
    assert run.stdout.splitlines()[-1].endswith(" finished:completed")
    return json.loads((tmp_path / name / "results.json").read_text())


def _stop(deployment):
    deployment.stop()
    for name, process in deployment.processes.items():
        assert process.poll() is not None, f"{name} still runs"


@pytest.fixture
def deployment(tmp_path):
    started = native.NativeDeployment(tmp_path / "services", native.environment())
    yield started
    _stop(started)


TRACKERS = all(importlib.util.find_spec(module) for module in ("tensorboard", "mlflow"))  # the test extra's


@pytest.fixture(scope="module")
def insecure(tmp_path_factory):
    """The insecure federation of the compose demo, each SuperNode in a network namespace of its own
    where this machine can make them (else on loopback), and a 2-round SCAFFOLD run on it on the
    legacy Flower front (the other tests run the Message API's), tracked with TensorBoard and MLflow
    where the test extra installed them; its processes stopped afterwards. Three tests read it: what
    the run learnt and kept, what the ServerApp tracked, and what crossed each node's interface."""
    tmp = tmp_path_factory.mktemp("insecure")
    started = native.NativeDeployment(tmp / "services", native.environment(), credentials=tmp / "credentials")
    network, loopback_because = own_network()
    try:
        if network is None:
            link = ("127.0.0.1", native.free_port())
            nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
        else:  # as in the compose file: each SuperNode on port 9094 of its own network stack
            link = (network.host, native.free_port())
            nodes = [("127.0.0.1", 9094, ns) for ns in network.namespaces]
            before = {veth: network.traffic_bytes(veth) for veth in network.veths}
        native.start_federation(started, native.load_compose(), link, nodes)
        cli_home = native.cli_home(tmp / "cli-home", f"{link[0]}:{link[1]}")
        trackers = " tracker='tensorboard,mlflow'" if TRACKERS else ""
        results = _run(tmp, cli_home, "scaffold", "scaffold", f" flower-api='legacy'{trackers}")
        crossed = None if network is None else {v: network.traffic_bytes(v) - b for v, b in before.items()}
    finally:
        _stop(started)
        if network is not None:
            network.remove()
    return {"tmp": tmp, "services": started.workdir, "results": results, "crossed": crossed,
            "loopback_because": loopback_because}


def in_one_process(method, tmp_path):
    """The same run in one process, its clients with one torch thread as the nodes' ClientApps
    (num-threads=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_in_process({"method": method, "num-server-rounds": 2, "output-dir": str(tmp_path), "run-name": "direct"},
                       num_nodes=NUM_NODES)
    finally:
        torch.set_num_threads(threads)
    return tmp_path / "direct"


def test_a_deployment_carries_named_uploads_broadcasts_and_client_state(tmp_path, insecure):
    """SCAFFOLD across processes on the legacy Flower front: the server's control variate down, each
    client's Delta c up (named arrays), c_i kept on the node between rounds: the rounds of the run in
    one process on the Message API, every number exactly (the app is unchanged between the paths; a
    Ray simulation gives the in-process numbers too: test_resume's flwr run kill test, FedSA's)."""
    results = insecure["results"]
    assert [r["clients"] for r in results["rounds"]] == [list(range(NUM_NODES))] * 2
    assert not any(r["dropped"] for r in results["rounds"])
    for i in range(1, NUM_NODES + 1):  # each node kept its data for the next message's process
        home = insecure["services"] / f"superexec-clientapp-{i}"
        assert len(list((home / ".cache" / "protofl").glob("client-data-*.npz"))) == 1
    assert_same_rounds(insecure["tmp"] / "scaffold", in_one_process("scaffold", tmp_path))


def test_a_deployments_serverapp_tracks_the_run(insecure):
    """The ServerApp that a SuperExec starts writes the trackers, as in simulation (the insecure
    federation's run's TensorBoard events and MLflow metrics, read back through their own readers).
    That run is on the legacy front; the trackers take the server's round records, which both fronts
    give alike, and tests/test_tracking.py tracks the Message API's runs in one process."""
    if not TRACKERS:
        pytest.skip("the test extra installs tensorboard and mlflow-skinny")
    from test_tracking import assert_same_points, expected_points, mlflow_metrics, tensorboard_scalars

    results = insecure["results"]
    want = expected_points(results)
    assert_same_points(tensorboard_scalars(insecure["tmp"] / "scaffold" / "tensorboard"), want)
    assert_same_points(mlflow_metrics(results), want)


class _Network:
    """A bridge with an address for the SuperLink and one network namespace per SuperNode."""

    def __init__(self, count):
        tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.213.{int(tag, 16) % 250 + 1}"  # a /24 of its own (parallel runs differ)
        self.bridge, self.host = f"pfbr{tag}", f"{self.subnet}.1"
        self.namespaces = [f"pfns{tag}{i}" for i in range(count)]
        self.veths = [f"pfv{tag}{i}" for i in range(count)]

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def create(self):
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths), 2):
            self._ip("netns", "add", ns)
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", veth, "master", self.bridge, "up")
            self._ip("-n", ns, "addr", "add", f"{self.subnet}.{i}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def traffic_bytes(self, veth):
        stats = Path(f"/sys/class/net/{veth}/statistics")
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def remove(self):
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # takes its veth pair
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)


def own_network() -> tuple[_Network | None, str]:
    """A bridge and a network namespace per SuperNode, or None and why this machine cannot make them."""
    net = _Network(NUM_NODES)
    try:
        net.create()
    except (OSError, subprocess.CalledProcessError) as err:
        net.remove()
        return None, f"cannot create network namespaces here (needs root and `ip netns`): {getattr(err, 'stderr', b'') or err!r}"
    if subprocess.run(["ip", "-n", net.namespaces[0], "route", "get", net.host], capture_output=True).returncode:
        net.remove()
        return None, "network namespaces exist but cannot route to the bridge"
    return net, ""


def test_supernodes_in_their_own_network_namespaces(insecure):
    """The insecure federation's SuperNodes ran each on port 9094 of its own network stack, as in the
    compose file, and the run's traffic crossed each one's interface."""
    if insecure["crossed"] is None:
        pytest.skip(insecure["loopback_because"])
    for veth, crossed in insecure["crossed"].items():
        assert crossed > 2 * 10 * 512 * 4, f"{veth}: only {crossed} bytes crossed the interface"


def test_a_run_whose_clientapps_cannot_load_their_data_fails_with_their_cause(tmp_path, deployment):
    """Each SuperNode's ``data-dir`` is an empty directory, while the ServerApp has the data set:
    `protofl run` against this remote SuperLink exits 1, its last line the ClientApps' error."""
    from fakes import write_cifar

    (tmp_path / "cifar").mkdir()
    (tmp_path / "node-data").mkdir()
    write_cifar(tmp_path / "cifar", 10, [16] * 5, 20)  # the five training batches of torchvision's layout
    compose = native.load_compose()
    for i in range(1, NUM_NODES + 1):
        command = compose["services"][f"supernode-{i}"]["command"]
        command[command.index("--node-config") + 1] += f" data-dir=\"{tmp_path / 'node-data'}\""
    link = ("127.0.0.1", native.free_port())
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    native.start_federation(deployment, compose, link, nodes)
    cli_home = native.cli_home(tmp_path / "cli-home", f"{link[0]}:{link[1]}")
    run_config = (f"dataset='cifar10' data-dir='{tmp_path / 'cifar'}' num-server-rounds=2 output-dir='{tmp_path}' "
                  "run-name='no-data'")
    run = native.protofl_run(cli_home, [str(ROOT), "deployment", "--run-config", run_config], timeout=RUN_TIMEOUT)
    last = run.stdout.strip().splitlines()[-1]
    stopped = json.loads((tmp_path / "no-data" / "results.json").read_text())["stopped"]
    assert run.returncode == 1 and last.endswith(f"finished:failed: {stopped}"), run.stdout[-3000:]
    assert f"{tmp_path / 'node-data'}" in stopped, stopped
