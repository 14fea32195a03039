"""The edge in front of an exposed SuperLink (deploy/edge.py), as native processes on loopback: the
TLS + SuperNode-auth variant with the SuperNodes dialling the edge, and the operator's `flwr` going
through deploy/operator_tunnel.py with the operator's client certificate.

The attacks come first: from outside (no client certificate, or one of another CA) every Control
API call, the runtime API and everything else is refused at the edge and never forwarded, while the
same calls straight to the SuperLink, the port this variant used to publish, succeed. Every process
is killed by process group.
"""

import json
import os
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
    make_credentials(credentials, [], NUM_NODES)
    make_credentials(stranger, [], 0)  # another CA: its operator certificate means nothing here
    deployment = native.NativeDeployment(tmp / "services", native.environment(), credentials=credentials)
    link, public, tunnel = (("127.0.0.1", native.free_port()) for _ in range(3))
    operator = native.cli_home(tmp / "operator", f"{tunnel[0]}:{tunnel[1]}")  # plain HTTP to the tunnel
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    try:
        native.start_behind_edge(deployment, link, public, tunnel, nodes, operator)
        yield {"tmp": tmp, "deployment": deployment, "ca": credentials / "ca.crt", "stranger": stranger,
               "link": link, "public": public, "operator": operator}
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
