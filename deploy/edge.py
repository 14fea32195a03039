"""The edge in front of a SuperLink that SuperNodes reach from other machines: nginx, configured from
``deploy/edge.conf.template`` for the docker compose edge service and for a native process alike.

It terminates TLS with the SuperLink's certificate and forwards ``/v1/fleet/*`` (SuperNodes) from
anywhere, ``/v1/control/*`` (``flwr run``, ``ls``, ``stop``, node registration, artifacts) only to
the operator, and nothing else: the SuperLink's runtime API (the ServerApp's SuperExec) is reached
on the SuperLink's own network only. Who the operator is (``--operator``):

- ``mtls`` (default): whoever presents a client certificate signed by the deployment's CA
  (``operator.crt``/``operator.key`` from ``make_credentials.py``); Flower's CLI cannot present one,
  so the operator's ``flwr`` goes through ``deploy/operator_tunnel.py`` on the operator's machine;
- ``loopback``: connections from the edge host's own loopback only (the operator logs in to that
  host, or opens an SSH tunnel to it).

    python deploy/edge.py --out edge.conf --listen 10.0.0.5:9443 --upstream 127.0.0.1:9093 \\
        --credentials deploy/credentials --run-dir /tmp/edge
    nginx -e stderr -c "$PWD/edge.conf" -g 'daemon off;'
"""

from __future__ import annotations

import argparse
import http.client
import re
import ssl
from pathlib import Path

TEMPLATE = Path(__file__).resolve().with_name("edge.conf.template")
# Flower 1.41 and 1.42 send a FAB of at most 10 MiB in one request, and messages as objects of at most 5 MiB
# (FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE): 16 MiB leaves headroom for their envelopes.
MAX_BODY = "16m"
READ_TIMEOUT = "3600s"  # how long the SuperLink may take to answer: `flwr run --stream` follows a whole run
# operator mode -> (who may use the Control API, the nginx rule that says it, what others are told)
OPERATOR_RULES = {
    "mtls": (
        "a client certificate signed by the deployment's CA",
        "            if ($ssl_client_verify != SUCCESS) {\n                return 403;\n            }",
        "the Control API needs the client certificate of the operator (docs/deployment/edge.md)",
    ),
    "loopback": (
        "connections from the edge host's loopback (an SSH tunnel)",
        "            allow 127.0.0.1;\n            allow ::1;\n            deny all;",
        "the Control API answers on the loopback of the SuperLink host only (docs/deployment/edge.md)",
    ),
}


def render(
    *, listen: str, upstream: str, upstream_name: str, credentials: str, run_dir: str, operator: str = "mtls",
    access_log: str = "/dev/stdout",
) -> str:
    """The edge's nginx configuration. ``credentials``: the directory of ``ca.crt``, ``server.pem``
    and ``server.key`` (make_credentials.py); ``upstream``: the SuperLink's host:port, whose
    certificate must name ``upstream_name``; ``run_dir``: where nginx keeps its pid."""
    doc, rule, forbidden = OPERATOR_RULES[operator]
    values = {
        "listen": listen, "upstream": upstream, "upstream_name": upstream_name, "run_dir": run_dir,
        "certificate": f"{credentials}/server.pem", "key": f"{credentials}/server.key", "ca": f"{credentials}/ca.crt",
        "control_rule": rule, "control_rule_doc": doc, "forbidden": f"protofl edge: {forbidden}",
        "error_log": "stderr", "access_log": access_log, "read_timeout": READ_TIMEOUT, "max_body": MAX_BODY,
    }
    def value(match: re.Match) -> str:
        if match[1] not in values:
            raise KeyError(f"the edge template names ${{{match[1]}}}, which render() does not fill in")
        return values[match[1]]

    return re.sub(r"\$\{(\w+)\}", value, TEMPLATE.read_text())


# What an outsider tries (tests/test_edge.py, deploy/compose_e2e.py): every Control API call that
# starts, stops, lists or registers, the runtime API, and paths the SuperLink does not serve
CONTROL_CALLS = ["list-runs", "start-run", "stop-run", "pull-artifacts", "register-node", "list-nodes"]
REFUSED_PATHS = [f"/v1/control/{name}" for name in CONTROL_CALLS] + [
    "/v1/runtime/get-nodes", "/v1/runtime/pull-messages", "/v1/runtime/push-messages", "/", "/v1/superexec"]
ACCESS_LINE = re.compile(r'"POST (\S+) HTTP/1.1" (\d+) \d+ upstream=(\S+) client-cert=(\S+)')


def post(address: tuple[str, int], path: str, ca: Path, client_certificate: Path | None = None,
         body: bytes = b"") -> tuple[int | str, str]:
    """(status, body) of a POST to ``address`` over TLS that trusts ``ca`` and presents the operator
    certificate in the directory ``client_certificate`` (operator.crt/.key), if any; a connection
    that fails gives the error's name instead of a status."""
    context = ssl.create_default_context(cafile=str(ca))
    if client_certificate is not None:
        context.load_cert_chain(client_certificate / "operator.crt", client_certificate / "operator.key")
    connection = http.client.HTTPSConnection(address[0], address[1], context=context, timeout=30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/protobuf"})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, ssl.SSLError) as err:
        return type(err).__name__, str(err)
    finally:
        connection.close()


def access_log(text: str) -> list[tuple[str, int, bool, bool]]:
    """The edge's access log as (path, status, whether it reached the SuperLink, whether the client
    presented a valid certificate) per request."""
    return [(m[1], int(m[2]), m[3] != "-", m[4] == "SUCCESS") for m in ACCESS_LINE.finditer(text)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the configuration file to write")
    parser.add_argument("--listen", default="127.0.0.1:9443",
                        help="the edge's address (nginx `listen`); beyond this host only when you say so")
    parser.add_argument("--upstream", default="127.0.0.1:9093", help="the SuperLink's host:port")
    parser.add_argument("--upstream-name", default="localhost", help="a name in the SuperLink's certificate")
    parser.add_argument("--credentials", type=Path, required=True, help="ca.crt, server.pem, server.key")
    parser.add_argument("--run-dir", type=Path, required=True, help="where nginx writes its pid")
    parser.add_argument("--access-log", help="default: access.log in --run-dir (the compose image: /dev/stdout)")
    parser.add_argument("--operator", choices=sorted(OPERATOR_RULES), default="mtls")
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(
        listen=args.listen, upstream=args.upstream, upstream_name=args.upstream_name,
        credentials=str(args.credentials.resolve()), run_dir=str(args.run_dir.resolve()), operator=args.operator,
        access_log=args.access_log or str(args.run_dir.resolve() / "access.log"),
    ))


if __name__ == "__main__":
    main()
