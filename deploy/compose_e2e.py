"""The ``flwr`` side of deploy/compose_e2e.sh: register SuperNode keys with the containerised
SuperLink, or run a 2-round FedProto job on digits through its published port and check what the
ServerApp wrote (results.json, read from its container) and what every container logged.

    python deploy/compose_e2e.py register --port P --home DIR --root-certificates CA --keys KEY.pub ...
    python deploy/compose_e2e.py run --port P --home DIR [--root-certificates CA] --name NAME \
        --compose "docker-compose --project-name X -f docker-compose.yml ..."
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

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


def register(home: Path, keys: list[str]) -> None:
    for key in keys:
        done = native.flwr(home, ["supernode", "register", key, "deployment"], timeout=120)
        if done.returncode != 0:
            sys.exit(f"registering {key} failed:\n{done.stdout}{done.stderr}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["register", "run"])
    parser.add_argument("--port", type=int, required=True, help="the SuperLink's port on 127.0.0.1")
    parser.add_argument("--home", type=Path, required=True, help="a Flower home for the flwr CLI")
    parser.add_argument("--root-certificates", type=Path, help="the CA certificate (TLS variants)")
    parser.add_argument("--name", default="e2e", help="the run's name (its results directory)")
    parser.add_argument("--keys", nargs="+", default=[], help="register: the SuperNodes' public keys")
    parser.add_argument("--compose", default="", help="run: the docker-compose command of the project")
    args = parser.parse_args()
    home = native.cli_home(args.home, f"127.0.0.1:{args.port}", args.root_certificates)
    wait_until_ready(home)
    if args.action == "register":
        register(home, args.keys)
    else:
        run(home, args.name, shlex.split(args.compose))


if __name__ == "__main__":
    main()
