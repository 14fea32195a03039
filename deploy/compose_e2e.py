"""The ``flwr`` side of deploy/compose_e2e.sh: register SuperNode keys with the containerised
SuperLink, or run a 2-round FedProto job on digits through its published port (or the operator's
tunnel to the edge) and check what the ServerApp wrote (results.json, read from its container) and
what every container logged; or attack the edge of the auth variant from outside and check that
nothing got through.

    python deploy/compose_e2e.py register --port P --home DIR [--root-certificates CA] --keys KEY.pub ...
    python deploy/compose_e2e.py run --port P --home DIR [--root-certificates CA] --name NAME \
        --compose "docker-compose --project-name X -f docker-compose.yml ..."
    python deploy/compose_e2e.py attack --port EDGE --home DIR --root-certificates CA --stranger DIR \
        --compose "..."
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import edge
import native

ROOT = Path(__file__).resolve().parents[1]
NUM_NODES = 2
SERVICES = ["superlink", "superexec-serverapp", *(f"{kind}-{i}" for i in (1, 2)
                                                  for kind in ("supernode", "superexec-clientapp"))]


def wait_until_ready(home: Path, timeout: float = 180) -> None:
    """Until ``flwr ls`` answers: Docker's published port accepts connections before the SuperLink does."""
    deadline = time.monotonic() + timeout
    while True:
        done = native.flwr(home, ["ls", "deployment"], timeout=60)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            sys.exit(f"the SuperLink did not answer in {timeout:.0f} s:\n{done.stdout}{done.stderr}")
        time.sleep(2)


def run(home: Path, name: str, compose: list[str]) -> None:
    run_config = f"method='fedproto' num-server-rounds=2 run-name='{name}'"
    done = native.flwr(home, ["run", str(ROOT), "deployment", "--stream", "--run-config", run_config], timeout=900)
    if done.returncode != 0:
        sys.exit(f"flwr run failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    path = f"/app/protofl-runs/{name}/results.json"
    text = subprocess.run([*compose, "exec", "-T", "superexec-serverapp", "cat", path],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    native.check_fedproto_results(json.loads(text), NUM_NODES)
    logs = subprocess.run([*compose, "logs", "--no-color", *SERVICES], capture_output=True, text=True,
                          timeout=120, check=True).stdout
    if "Traceback" in logs:
        sys.exit(f"a container logged a traceback:\n{logs[-4000:]}")
    for service in SERVICES:  # every service ran (compose prefixes each line with its container)
        if f"{service}_" not in logs and f"{service}-" not in logs:
            sys.exit(f"no log lines from {service}")
    print(f"{name}: results.json checked ({NUM_NODES} clients, 2 rounds), no tracebacks in the logs")


def attack(home: Path, port: int, ca: Path, stranger: Path, compose: list[str]) -> None:
    """From outside the edge: every refused path without a client certificate and with another CA's
    is answered 4xx and reaches nothing; ``flwr ls`` fails with the edge's reason; an oversized body
    is refused; and the SuperLink itself has no published port."""
    address = ("127.0.0.1", port)
    deadline = time.monotonic() + 180
    while edge.post(address, "/v1/control/list-runs", ca)[0] != 403:  # until the edge answers
        if time.monotonic() > deadline:
            sys.exit(f"the edge did not answer in 180 s: {edge.post(address, '/v1/control/list-runs', ca)}")
        time.sleep(2)
    for path in edge.REFUSED_PATHS:
        for who in (None, stranger):
            status, body = edge.post(address, path, ca, who)
            if not (isinstance(status, int) and 400 <= status < 500):
                sys.exit(f"the edge let {path} through (certificate: {who}): {status} {body[:300]}")
    if edge.post(address, "/v1/fleet/push-object", ca, body=b"\0" * (17 << 20))[0] != 413:
        sys.exit("the edge accepted a 17 MiB body")
    listed = native.flwr(home, ["ls", "deployment"], timeout=60)
    if listed.returncode == 0 or "client certificate of the operator" not in listed.stdout + listed.stderr:
        sys.exit(f"flwr ls through the edge without the operator's certificate:\n{listed.stdout}{listed.stderr}")
    time.sleep(1)  # nginx logs a request once its response is sent
    logs = subprocess.run([*compose, "logs", "--no-color", "edge"], capture_output=True, text=True,
                          timeout=120, check=True).stdout
    outsiders = [entry for entry in edge.access_log(logs) if not entry[3]]
    if len(outsiders) < 2 * len(edge.REFUSED_PATHS) or any(reached for _, _, reached, _ in outsiders):
        sys.exit(f"the edge's log does not show every outsider refused before the SuperLink:\n{logs[-4000:]}")
    published = subprocess.run([*compose, "port", "superlink", "8000"], capture_output=True, text=True, timeout=60)
    if re.search(r":[1-9]\d*\s*$", published.stdout):  # compose prints host:port, or nothing / ":0"
        sys.exit(f"the SuperLink is published on {published.stdout.strip()}")
    print(f"edge: {len(outsiders)} outsider requests refused before the SuperLink, the SuperLink unpublished")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["register", "run", "attack"])
    parser.add_argument("--port", type=int, required=True, help="the port on 127.0.0.1 that flwr dials")
    parser.add_argument("--home", type=Path, required=True, help="a Flower home for the flwr CLI")
    parser.add_argument("--root-certificates", type=Path, help="the CA certificate (TLS variants)")
    parser.add_argument("--name", default="e2e", help="the run's name (its results directory)")
    parser.add_argument("--keys", nargs="+", default=[], help="register: the SuperNodes' public keys")
    parser.add_argument("--compose", default="", help="run, attack: the docker-compose command of the project")
    parser.add_argument("--stranger", type=Path, help="attack: credentials of another CA (operator.crt/.key)")
    args = parser.parse_args()
    home = native.cli_home(args.home, f"127.0.0.1:{args.port}", args.root_certificates)
    if args.action == "attack":
        attack(home, args.port, args.root_certificates, args.stranger, shlex.split(args.compose))
        return
    wait_until_ready(home)
    if args.action == "register":
        native.register_keys(home, [Path(key) for key in args.keys])
    else:
        run(home, args.name, shlex.split(args.compose))


if __name__ == "__main__":
    main()
