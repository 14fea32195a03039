"""The edge in front of an exposed SuperLink (deploy/edge.py), as native processes on loopback: the
TLS + SuperNode-auth variant with the SuperNodes dialling the edge, and the operator's `flwr` going
through deploy/operator_tunnel.py with the operator's client certificate.

The attacks come first: from outside (no client certificate, or one of another CA) every Control
API call, the runtime API and everything else is refused at the edge and never forwarded, while the
same calls straight to the SuperLink, the port this variant used to publish, succeed. Every process
is killed by process group.
"""

import http.client
import json
import os
import ssl
import time
from pathlib import Path

import edge
import native
import pytest
import torch
from inprocess import run_in_process
from make_credentials import make_credentials
from test_resume import assert_same_rounds

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

NUM_NODES = 2
RUN_TIMEOUT = 420


def require_nginx():
    if native.NGINX is None and not os.environ.get("CI"):  # CI installs it (.ci/run)
        pytest.skip("the edge needs nginx: apt-get install nginx-light")


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A TLS + auth federation whose SuperNodes and operator reach the SuperLink through the edge."""
    require_nginx()
    tmp = tmp_path_factory.mktemp("edge")
    credentials, stranger = tmp / "credentials", tmp / "stranger"
    make_credentials(credentials, [], NUM_NODES + 1)  # the last key is never registered
    make_credentials(stranger, [], 0)  # another CA: its operator certificate means nothing here
    deployment = native.NativeDeployment(tmp / "services", native.environment(), credentials=credentials)
    link, public, tunnel = (("127.0.0.1", native.free_port()) for _ in range(3))
    operator = native.cli_home(tmp / "operator", f"{tunnel[0]}:{tunnel[1]}")  # plain HTTP to the tunnel
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    try:
        addresses = native.start_behind_edge(deployment, link, public, tunnel, nodes, operator)
        yield {"tmp": tmp, "deployment": deployment, "credentials": credentials, "ca": credentials / "ca.crt",
               "stranger": stranger, "link": link, "public": public, "operator": operator, "addresses": addresses}
    finally:
        deployment.stop()


def forwarded(federation, path):
    """(status, whether it reached the SuperLink) of each request for ``path`` without a valid client
    certificate, from the edge's access log."""
    log = (federation["deployment"].workdir / "edge" / "access.log").read_text()
    return [(status, reached) for logged, status, reached, certified in edge.access_log(log)
            if logged == path and not certified]


def test_outsiders_reach_neither_the_control_nor_the_runtime_api(federation):
    ca, public, link = federation["ca"], federation["public"], federation["link"]
    # the attack works where this variant used to publish the SuperLink itself
    assert edge.post(link, "/v1/control/list-runs", ca)[0] == 200
    for path in edge.REFUSED_PATHS:
        for who in (None, federation["stranger"]):
            status, body = edge.post(public, path, ca, who)
            assert isinstance(status, int) and 400 <= status < 500, (path, who, status, body)
        assert forwarded(federation, path) and not any(reached for _, reached in forwarded(federation, path)), path
    status, body = edge.post(public, "/v1/control/list-runs", ca)
    assert status == 403 and "client certificate of the operator" in json.loads(body)["detail"]
    superlink_log = federation["deployment"].log("superlink")
    received = {name: superlink_log.count(f'"POST /v1/control/{name} HTTP/1.1"') for name in edge.CONTROL_CALLS}
    # what arrived: the direct call above and the operator's registrations, nothing of the outsiders'
    assert received == {name: {"list-runs": 1, "register-node": NUM_NODES}.get(name, 0)
                        for name in edge.CONTROL_CALLS}


def test_flwr_aimed_at_the_edge_without_the_operator_certificate_fails_clearly(federation, tmp_path):
    outsider = native.cli_home(tmp_path / "outsider", "{}:{}".format(*federation["public"]), federation["ca"])
    listed = native.flwr(outsider, ["ls", "deployment"], timeout=60)
    assert listed.returncode != 0
    assert "the Control API needs the client certificate of the operator" in listed.stdout + listed.stderr


def test_an_oversized_body_is_refused_at_the_edge(federation):
    status, _ = edge.post(federation["public"], "/v1/fleet/push-object", federation["ca"], body=b"\0" * (17 << 20))
    assert status == 413
    deadline = time.monotonic() + 10  # nginx logs a request once its response is sent
    while (413, False) not in forwarded(federation, "/v1/fleet/push-object") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (413, False) in forwarded(federation, "/v1/fleet/push-object")


def test_supernodes_and_the_operator_run_through_the_edge(federation):
    operator, tmp = federation["operator"], federation["tmp"]
    run_config = f"method='fedproto' num-server-rounds=2 output-dir='{tmp}' run-name='edge'"
    run = native.protofl_run(operator, [str(ROOT), "deployment", "--run-config", run_config], timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp / "edge" / "results.json").read_text())
    native.check_fedproto_results(results, NUM_NODES)  # both nodes trained, through the edge
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each node's ClientApp (num-threads=1)
    try:
        run_in_process({"method": "fedproto", "num-server-rounds": 2, "output-dir": str(tmp), "run-name": "direct"},
                       num_nodes=NUM_NODES)
    finally:
        torch.set_num_threads(threads)
    assert_same_rounds(tmp / "edge", tmp / "direct")  # the same numbers as without the edge
    assert (200, True) in forwarded(federation, "/v1/fleet/pull-messages")  # SuperNodes need no certificate

    # the operator starts, lists and stops a run through the edge
    long_run = f"method='fedproto' num-server-rounds=50 output-dir='{tmp}' run-name='stopped'"
    started = native.flwr(operator, ["run", str(ROOT), "deployment", "--format", "json", "--run-config", long_run],
                          timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "run-id" in json.loads(started.stdout), started.stdout
    run_id = json.loads(started.stdout)["run-id"]
    listed = native.flwr(operator, ["ls", "deployment", "--format", "json"], timeout=60)
    assert run_id in listed.stdout, listed.stdout + listed.stderr
    stopped = native.flwr(operator, ["stop", run_id, "deployment"], timeout=60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_supernode_auth_refuses_an_unregistered_key_and_admits_whoever_registers_one(federation):
    """After the run above: a SuperNode whose key was never registered is refused through the edge,
    and the registered ones still serve. Yet SuperNode authentication keeps no one out by itself:
    whoever reaches the SuperLink's own port registers a key through its Control API with no
    credentials at all (docs/deployment/threat-model.md); the edge is what keeps that API to the
    operator (test_outsiders_reach_neither_the_control_nor_the_runtime_api)."""
    deployment, credentials = federation["deployment"], federation["credentials"]
    # the last node's command line with the key no one registered
    last, unregistered = f"credentials/supernode-{NUM_NODES}", f"credentials/supernode-{NUM_NODES + 1}"
    stranger = native.service_command(native.load_compose("tls", "auth"), f"supernode-{NUM_NODES}", "127.0.0.1",
                                      native.free_port(), federation["addresses"] | {last: unregistered})
    assert unregistered in stranger and "--root-certificates" in stranger
    assert "{}:{}".format(*federation["public"]) in stranger  # it dials the edge, as the registered nodes do
    refused = deployment.start("stranger", stranger)
    assert refused.wait(timeout=120) != 0, deployment.log("stranger")
    assert "Failed to activate SuperNode" in deployment.log("stranger")
    for i in range(1, NUM_NODES + 1):
        assert deployment.processes[f"supernode-{i}"].poll() is None  # still serving

    node_id = register_as_a_stranger(federation["link"], credentials / f"supernode-{NUM_NODES + 1}.pub")
    admitted = deployment.start("admitted-stranger", stranger)  # the command line refused above
    try:
        assert wait_for_status(federation["operator"], node_id, "online", timeout=120), \
            deployment.log("admitted-stranger")
        assert admitted.poll() is None
        assert "Failed to activate SuperNode" not in deployment.log("admitted-stranger")
    finally:
        native.kill_trees([admitted.pid])
        admitted.wait(timeout=30)


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


@pytest.mark.parametrize("operator, status", [("mtls", 403), ("loopback", 502)])
def test_the_operator_is_a_certificate_or_the_edge_hosts_loopback(operator, status, tmp_path):
    """Without a client certificate, from 127.0.0.1: refused with ``mtls``; let through with
    ``loopback`` (to a SuperLink that is not there: 502)."""
    require_nginx()
    credentials = tmp_path / "credentials"
    make_credentials(credentials, [], 0)
    deployment = native.NativeDeployment(tmp_path / "services", native.environment(), credentials=credentials)
    public = ("127.0.0.1", native.free_port())
    try:
        native.start_edge(deployment, ("127.0.0.1", native.free_port()), public, operator=operator)
        assert edge.post(public, "/v1/control/list-runs", credentials / "ca.crt")[0] == status
        assert edge.post(public, "/v1/runtime/get-nodes", credentials / "ca.crt")[0] == 404
    finally:
        deployment.stop()
