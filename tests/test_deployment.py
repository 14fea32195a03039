"""Real SuperLink, SuperNode and SuperExec processes, started with docker-compose.yml's own command
lines (deploy/compose_e2e.sh runs them in Docker), each in its own directory and Flower home, then
`flwr run` of a 2-round FedProto run on digits (on the insecure federation: SCAFFOLD, whose clients
upload named arrays and keep control variates, on the legacy Flower front). Loopback only, except
for the network-namespace test, whose addresses live on a bridge it creates and removes. Every
process is killed by process group. A FedProto run across processes gives the rounds of the same run
in one process: tests/test_edge.py (through the edge) and tests/test_deployment_resume.py (after its
faults) check it.
"""

import http.client
import importlib.util
import json
import ssl
import subprocess
import sys
import time
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


def _run(tmp_path, cli_home, name, extra="", method="fedproto"):
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
    started = native.NativeDeployment(tmp_path / "services", native.environment(), credentials=tmp_path / "credentials")
    yield started
    _stop(started)


TRACKERS = all(importlib.util.find_spec(module) for module in ("tensorboard", "mlflow"))  # the test extra's


@pytest.fixture(scope="module")
def insecure(tmp_path_factory):
    """The insecure federation of the compose demo and a 2-round SCAFFOLD run on it on the legacy
    Flower front (the other tests run the Message API's), tracked with TensorBoard and MLflow where
    the test extra installed them; its processes stopped afterwards. Two tests read it: what the
    run learnt and kept, and what the ServerApp tracked."""
    tmp = tmp_path_factory.mktemp("insecure")
    started = native.NativeDeployment(tmp / "services", native.environment(), credentials=tmp / "credentials")
    try:
        link = ("127.0.0.1", native.free_port())
        nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
        native.start_federation(started, native.load_compose(), link, nodes)
        cli_home = native.cli_home(tmp / "cli-home", f"{link[0]}:{link[1]}")
        trackers = " tracker='tensorboard,mlflow'" if TRACKERS else ""
        results = _run(tmp, cli_home, "scaffold", f" flower-api='legacy'{trackers}", method="scaffold")
    finally:
        _stop(started)
    return {"tmp": tmp, "services": started.workdir, "results": results}


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


def test_tls_with_supernode_auth_refuses_an_unregistered_node(tmp_path, deployment):
    credentials = tmp_path / "credentials"
    script = [sys.executable, str(ROOT / "deploy" / "make_credentials.py"), "--out", str(credentials),
              "--supernodes", str(NUM_NODES + 1)]
    subprocess.run(script, check=True, capture_output=True, timeout=60)
    compose = native.load_compose("tls", "auth")
    link = ("127.0.0.1", native.free_port())
    cli_home = native.cli_home(tmp_path / "cli-home", f"127.0.0.1:{link[1]}", credentials / "ca.crt")

    def register():
        native.register_keys(cli_home, [credentials / f"supernode-{i}.pub" for i in range(1, NUM_NODES + 1)])

    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    addresses = native.start_federation(deployment, compose, link, nodes, before_nodes=register)

    # the last node's command line with a third key, never registered
    stranger = native.service_command(compose, f"supernode-{NUM_NODES}", "127.0.0.1", native.free_port(),
                        addresses | {f"credentials/supernode-{NUM_NODES}": f"credentials/supernode-{NUM_NODES + 1}"})
    assert f"credentials/supernode-{NUM_NODES + 1}" in stranger and "--root-certificates" in stranger
    refused = deployment.start("stranger", stranger)
    assert refused.wait(timeout=120) != 0, deployment.log("stranger")
    assert "Failed to activate SuperNode" in deployment.log("stranger")

    results = _run(tmp_path, cli_home, "tls")
    native.check_fedproto_results(results, NUM_NODES)  # the two registered nodes, and only they, trained
    for i in range(1, NUM_NODES + 1):
        assert deployment.processes[f"supernode-{i}"].poll() is None  # still serving

    # ... and yet SuperNode authentication keeps no one out by itself: whoever reaches the port registers
    # a key through the Control API, with no credentials at all (docs/deployment/threat-model.md; the edge is what
    # keeps the Control API to the operator, tests/test_edge.py)
    node_id = register_as_a_stranger(link, credentials / f"supernode-{NUM_NODES + 1}.pub")
    admitted = deployment.start("admitted-stranger", stranger)  # the command line refused above
    assert wait_for_status(cli_home, node_id, "online", timeout=120), deployment.log("admitted-stranger")
    assert admitted.poll() is None
    assert "Failed to activate SuperNode" not in deployment.log("admitted-stranger")


def register_as_a_stranger(address: tuple[str, int], public_key: Path) -> int:
    """``register-node`` on the Control API at ``address`` as someone who holds nothing of the
    deployment: TLS that checks no certificate (no ca.crt), no client certificate, no account.
    Returns the node id the SuperLink gave the key."""
    from cryptography.hazmat.primitives import serialization
    from flwr.proto.control_pb2 import RegisterNodeRequest, RegisterNodeResponse

    key = serialization.load_ssh_public_key(public_key.read_bytes())
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    connection = http.client.HTTPSConnection(*address, context=context, timeout=30)
    try:
        connection.request("POST", "/v1/control/register-node", RegisterNodeRequest(public_key=pem).SerializeToString(),
                           headers={"Content-Type": "application/protobuf", "Accept": "application/protobuf"})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status == 200, (response.status, body[:500])
    reply = RegisterNodeResponse()
    reply.ParseFromString(body)
    assert reply.node_id
    return reply.node_id


def wait_for_status(cli_home: Path, node_id: int, status: str, timeout: float) -> bool:
    """Whether ``flwr supernode list`` shows the node with ``status`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = native.flwr(cli_home, ["supernode", "list", "deployment", "--format", "json"], timeout=60)
        nodes = json.loads(listed.stdout).get("nodes", []) if listed.returncode == 0 else []
        if any(node["node-id"] == str(node_id) and node["status"] == status for node in nodes):
            return True
        time.sleep(2)
    return False


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


@pytest.fixture
def network():
    net = _Network(NUM_NODES)
    try:
        net.create()
    except (OSError, subprocess.CalledProcessError) as err:
        net.remove()
        reason = getattr(err, "stderr", b"") or str(err)
        pytest.skip(f"cannot create network namespaces here (needs root and `ip netns`): {reason!r}")
    if subprocess.run(["ip", "-n", net.namespaces[0], "route", "get", net.host], capture_output=True).returncode:
        net.remove()
        pytest.skip("network namespaces exist but cannot route to the bridge")
    yield net
    net.remove()


def test_supernodes_in_their_own_network_namespaces(tmp_path, network, deployment):
    compose = native.load_compose()
    link = (network.host, native.free_port())
    # as in the compose file: each SuperNode on port 9094 of its own network stack
    nodes = [("127.0.0.1", 9094, ns) for ns in network.namespaces]
    before = [network.traffic_bytes(veth) for veth in network.veths]
    native.start_federation(deployment, compose, link, nodes)
    results = _run(tmp_path, native.cli_home(tmp_path / "cli-home", f"{link[0]}:{link[1]}"), "netns")
    native.check_fedproto_results(results, NUM_NODES)
    for veth, start in zip(network.veths, before):
        crossed = network.traffic_bytes(veth) - start
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
