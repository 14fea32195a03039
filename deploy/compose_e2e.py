"""The ``flwr`` side of deploy/compose_e2e.sh: register SuperNode keys with the containerised
SuperLink, or run a 2-round FedProto job on digits through its published port (or the operator's
tunnel to the edge) and check what the ServerApp wrote (results.json, read from its container) and
what every container logged, and that every container runs as docker-compose.yml hardens it (no
capabilities, no-new-privileges, read-only root, not root, ports on 127.0.0.1 only: ``docker inspect``,
so a key that compose ignored is caught); or attack the edge of the auth variant from outside and check
that nothing got through, and that the edge refuses connections on this host's other addresses; or crash containers mid-run (``faults``) and check that the restart policies,
the state volumes and ``resume=true`` carry the runs through.

    python deploy/compose_e2e.py register --port P --home DIR [--root-certificates CA] --keys KEY.pub ...
    python deploy/compose_e2e.py run --port P --home DIR [--root-certificates CA] --name NAME \
        --compose "docker-compose --project-name X -f docker-compose.yml ..." [--flower-api legacy]
    python deploy/compose_e2e.py attack --port EDGE --home DIR --root-certificates CA --stranger DIR \
        --compose "..."
    python deploy/compose_e2e.py faults --port P --home DIR --compose "..."   (the insecure demo)

The faults, each run a FedProto job on digits with a checkpoint after every round:

1. a SuperNode crashes mid-round (its container's main process SIGKILLed from the host, which is
   what Docker's restart policy answers; ``docker kill`` is an operator's stop, which it does not):
   the container must come back by itself, its node rejoin (its partition trains again), and the
   6-round run finish (``min-fit-clients=1``: the round it died in goes on with the other node);
2. the ServerApp's SuperExec crashes mid-run, after a checkpoint, and superexec-clientapp-1 is
   re-created meanwhile (so partition 0's state can only come from its volume, client-state-1):
   once the SuperExec is back, ``flwr run ... run-name=<same> resume=true`` must finish the run,
   and every round's record (but its timings) must equal that of the same run made without faults
   in the same deployment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import edge
import native
from protofl.report import TIMING_FIELDS, rounds_without_timing

ROOT = Path(__file__).resolve().parents[1]
NUM_NODES = 2
SERVICES = ["superlink", "superexec-serverapp", *(f"{kind}-{i}" for i in (1, 2)
                                                  for kind in ("supernode", "superexec-clientapp"))]
# seconds a round waits for replies. The demo's own config says 60 (docker-compose.yml's header,
# docs/deployment/compose.md): a CPU round of the demo takes 6-17 s on a 2-core machine, the first up to
# ~25 s with the ClientApps' cold start. Here every run waits for every live ClientApp however loaded
# the host is: under CI's slow suite (load average 13-22) a ClientApp's first reply came after 60 s,
# and a run lost that partition's round (the node fault's survivor, the ServerApp fault's resumed run)
# or found no partition at all (the first run). A SuperNode that died does not hold its round to this
# timeout: Flower answers its message with an error within 60 s (2 x its 30 s heartbeat).
# COMPOSE_E2E_ROUND_TIMEOUT sets another; flwr_run puts it before each run's keys
ROUND_TIMEOUT = float(os.environ.get("COMPOSE_E2E_ROUND_TIMEOUT") or 300.0)
RUNS = "/app/protofl-runs"  # the ServerApp's output-dir in superexec-serverapp (the results volume)


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


class Deployment:
    """The running compose project: its containers, what the ServerApp wrote, crashes."""

    def __init__(self, compose: list[str]) -> None:
        self.compose = compose
        # each service's container id: a restart keeps it, a re-creation (`up`) does not. docker-compose
        # 1.29 is Python, about 0.7 CPU-seconds a call: asked on every poll, it took a third of a core
        self.ids: dict[str, str] = {}

    def __call__(self, *args: str, timeout: float = 120) -> str:
        """``docker-compose ... <args>``'s output; a failure ends the test."""
        if args[0] == "up":
            self.ids.clear()
        done = subprocess.run([*self.compose, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            sys.exit(f"docker-compose {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    def container(self, service: str) -> str:
        """The id of the service's container."""
        if service not in self.ids:
            self.ids[service] = self("ps", "-q", service).strip()
        if not self.ids[service]:
            sys.exit(f"{service} has no container")
        return self.ids[service]

    def state(self, service: str) -> dict[str, Any]:
        """``docker inspect``'s State of the service's container, and its RestartCount."""
        inspected = json.loads(subprocess.run(["docker", "inspect", self.container(service)], capture_output=True,
                                              text=True, timeout=60, check=True).stdout)[0]
        return inspected["State"] | {"RestartCount": inspected["RestartCount"]}

    def exec(self, service: str, *command: str) -> subprocess.CompletedProcess:
        """``command`` in the service's container (it fails while the container is down)."""
        return subprocess.run(["docker", "exec", self.container(service), *command], capture_output=True,
                              text=True, timeout=60)

    def results(self, name: str) -> dict[str, Any] | None:
        """The run's results.json as the ServerApp last wrote it (atomically), or None."""
        done = self.exec("superexec-serverapp", "cat", f"{RUNS}/{name}/results.json")
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout else None

    def wait_for_results(self, name: str, condition: Callable[[dict[str, Any]], bool], timeout: float,
                         what: str) -> dict[str, Any]:
        """The run's first results.json for which ``condition`` holds (polled, bounded)."""

        def met() -> dict[str, Any] | None:
            results = self.results(name)
            return results if results is not None and condition(results) else None

        return wait_for(met, timeout, f"{what} of {name}", every=2.0)  # a round takes several seconds

    def crash(self, service: str) -> int:
        """SIGKILL the container's main process from the host: a crash, which Docker answers with the
        restart policy (``docker kill`` counts as the operator's stop, which it does not). Returns the
        RestartCount before."""
        state = self.state(service)
        if not state["Running"]:
            sys.exit(f"{service} is not running: {state}")
        os.kill(state["Pid"], signal.SIGKILL)
        return state["RestartCount"]

    def wait_restarted(self, service: str, restarts: int, timeout: float = 60) -> float:
        """Until the service's container runs again after ``restarts`` restarts, by itself; seconds taken."""
        started = time.monotonic()

        def restarted() -> bool:
            state = self.state(service)
            return state["Running"] and state["RestartCount"] > restarts

        wait_for(restarted, timeout, f"{service} running again after its crash (restart policy)")
        return time.monotonic() - started


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """``condition()``'s first true value, polled; ends the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            sys.exit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return value


def flwr_run(home: Path, run_config: str, stream: bool = True, timeout: float = 900) -> str:
    """A run of this checkout on the deployment with the demo's run config (its round-timeout
    ``ROUND_TIMEOUT``) and ``run_config``: streamed to its end by ``protofl run`` (which fails unless the
    run completed, naming why), or only submitted by ``flwr run``; its output (a failure ends the test)."""
    args = [str(ROOT), "deployment", "--run-config", f"round-timeout={ROUND_TIMEOUT} {run_config}"]
    done = native.protofl_run(home, args, timeout=timeout) if stream else native.flwr(home, ["run", *args],
                                                                                     timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"flwr run failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def containers(compose: list[str]) -> dict[str, dict[str, Any]]:
    """``docker inspect`` of every container of the compose project, by service."""
    ids = subprocess.run([*compose, "ps", "-q"], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    inspected = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, timeout=60,
                                          check=True).stdout) if ids else []
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in inspected}


def hardening_problems(inspected: dict[str, Any]) -> list[str]:
    """What a running container lacks of docker-compose.yml's hardening (as Docker applied it: compose
    could ignore a key it does not know), and any port it publishes beyond 127.0.0.1."""
    host = inspected["HostConfig"]
    problems = []
    if "ALL" not in [c.upper() for c in host.get("CapDrop") or []] or host.get("CapAdd"):
        problems.append(f"capabilities: drop {host.get('CapDrop')}, add {host.get('CapAdd')}")
    if not any(o.startswith("no-new-privileges") and not o.endswith(":false") for o in host.get("SecurityOpt") or []):
        problems.append(f"security options {host.get('SecurityOpt')}")
    if not host.get("ReadonlyRootfs") or host.get("Privileged"):
        problems.append(f"read-only root {host.get('ReadonlyRootfs')}, privileged {host.get('Privileged')}")
    if inspected["Config"].get("User", "") in ("", "root", "0"):
        problems.append("runs as root")
    for port, bindings in (host.get("PortBindings") or {}).items():
        for binding in bindings or []:
            if binding.get("HostIp") != "127.0.0.1":
                problems.append(f"{port} published on {binding.get('HostIp') or 'every address'}")
    return problems


def check_hardening(compose: list[str]) -> None:
    """Every container of the project runs hardened and publishes on loopback only."""
    inspected = containers(compose)
    problems = {service: hardening_problems(c) for service, c in inspected.items()}
    if not inspected or any(problems.values()):
        sys.exit(f"containers not hardened as docker-compose.yml says: {problems}")
    print(f"{len(inspected)} containers: no capabilities, no-new-privileges, read-only root, not root, "
          f"ports on 127.0.0.1 only")


def host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (``ip -4 addr``)."""
    listed = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    return [a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", listed) if not a.startswith("127.")]


def unreachable_beyond_loopback(port: int) -> list[str]:
    """The host's other addresses, each checked: the port must not accept a connection there."""
    addresses = host_addresses()
    if not addresses:
        sys.exit("this host has no address beyond loopback to check the edge on")
    for address in addresses:
        with socket.socket() as sock:
            sock.settimeout(3)
            if sock.connect_ex((address, port)) == 0:
                sys.exit(f"port {port} accepts connections on {address}: published beyond loopback")
    return addresses


# compose's log line: the container, padded, then "| " and what it logged
LOG_LINE = re.compile(r"^(\S+)\s+\| ?(.*)$")
# A ClientApp process that the SuperExec starts has 30 s from its claim on a task to its first
# heartbeat (flwr/supercore/corestate/in_memory_corestate.py: claim_task). On a loaded host it can
# take longer to start: the claim expires, the task goes back to pending and runs in a new process,
# and the SuperNode answers the late one 401 ("Runtime task-token authentication failed"), which its
# heartbeat thread logs as a traceback. Nothing of the run is lost; a reply that is lost shows in the
# ServerApp's log (LOST_REPLY).
EXPIRED_CLAIM = re.compile(r"^httpx\.HTTPStatusError: Client error '401 Unauthorized' for url "
                           r"'https?://supernode-(\d+):\d+/v1/runtime/")
CLIENTAPP_CONTAINER = re.compile(r"^superexec-clientapp-(\d+)[-_]\d+$")
# A ClientApp process stops on SIGINT, and nothing but Flower's own code sends it one during a run:
# its Runtime API client on a 401, its heartbeat on a beat the SuperNode refuses (the task finished),
# its parent's monitor. The first signal runs Flower's graceful exit ("Task stopped.") and restores
# Python's handler; a second one while the process is still exiting (a loaded host exits slowly, and
# the heartbeat keeps beating until the exit stops it) ends it with a KeyboardInterrupt traceback.
# Whether its reply arrived is what the run's results and LOST_REPLY say.
STOP_SIGNAL = "KeyboardInterrupt"
LOST_REPLY = "a client failed to"  # protofl/federation/server_core.py: logged_failures


# A traceback's error line: the exception's (qualified) name, then its message, if any. A line of the
# same container that is neither indented nor this (a log record, "For more information check: ...")
# is another thread's, logged while the traceback was being written.
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(:|$)")


def tracebacks(logs: str) -> list[tuple[str, list[str]]]:
    """Each traceback in compose's logs: its container, and its lines (other containers' lines and
    its own container's other threads' left out) from "Traceback" to its error line (ERROR_LINE)."""
    lines = [(m.group(1), m.group(2)) if (m := LOG_LINE.match(line)) else ("", line) for line in logs.splitlines()]
    found = []
    for start, (container, text) in enumerate(lines):
        if "Traceback" not in text:
            continue
        block = [text]
        for other, following in lines[start + 1:]:
            if other != container or not following:
                continue
            if following[0].isspace():
                block.append(following)
            elif following.startswith("Traceback"):  # no error line: the next one is not this one's
                break
            elif ERROR_LINE.match(following):
                block.append(following)
                break
        found.append((container, block))
    return found


def stopped_by_flower(container: str, block: list[str]) -> bool:
    """Whether a traceback is a ClientApp process's that Flower stopped itself: a late one, answered
    401 by its own SuperNode (EXPIRED_CLAIM), or one a second stop signal ended (STOP_SIGNAL)."""
    owner, error = CLIENTAPP_CONTAINER.match(container), EXPIRED_CLAIM.match(block[-1])
    return bool(owner and (block[-1].strip() == STOP_SIGNAL or (error and owner.group(1) == error.group(1))))


def log_problems(logs: str, output: str) -> tuple[list[str], int]:
    """What the containers' logs and the run's streamed output say went wrong (each traceback that is
    not of a ClientApp process Flower stopped, with its container; each lost reply the ServerApp
    logged), and how many tracebacks of ClientApp processes Flower stopped there were."""
    found = tracebacks(logs)
    stopped = [stopped_by_flower(container, block) for container, block in found]
    problems = ["\n".join(f"{container} | {line}" for line in block)
                for (container, block), by_flower in zip(found, stopped) if not by_flower]
    problems += [line for line in output.splitlines() if LOST_REPLY in line]
    return problems, sum(stopped)


def run(home: Path, name: str, compose: list[str], front: str = "message") -> None:
    output = flwr_run(home, f"method='fedproto' num-server-rounds=2 run-name='{name}' flower-api='{front}'")
    results = Deployment(compose).results(name)
    if results is None:
        sys.exit(f"{RUNS}/{name}/results.json is not in superexec-serverapp")
    native.check_fedproto_results(results, NUM_NODES)
    logs = subprocess.run([*compose, "logs", "--no-color", *SERVICES], capture_output=True, text=True,
                          timeout=120, check=True).stdout
    problems, stopped = log_problems(logs, output)
    if problems:
        sys.exit(f"the logs show a failure: {problems[0].splitlines()[-1]}\n" + "\n[...]\n".join(problems[:3]))
    for service in SERVICES:  # every service ran (compose prefixes each line with its container)
        if f"{service}_" not in logs and f"{service}-" not in logs:
            sys.exit(f"no log lines from {service}")
    print(f"{name}: results.json checked ({NUM_NODES} clients, 2 rounds), no failure in the logs"
          + (f" ({stopped} tracebacks of ClientApp processes Flower stopped itself: a claim that expired "
             "before the process started, or a second stop signal while it exited)" if stopped else ""))
    check_hardening(compose)


def recorded(results: dict[str, Any] | None) -> list[int]:
    """The rounds results.json records."""
    return [r["round"] for r in (results or {}).get("rounds", [])]


def finished(results: dict[str, Any] | None) -> bool:
    """Whether the ServerApp wrote the run's last results.json (its summary, at the end)."""
    return results is not None and "total_seconds" in results


def node_fault(home: Path, deployment: Deployment) -> None:
    """A SuperNode crashes mid-round: it comes back by itself, rejoins, and the run finishes."""
    name, rounds, node = "node-fault", 6, "supernode-1"  # partition 0
    started = time.monotonic()
    flwr_run(home, f"method='fedproto' num-server-rounds={rounds} checkpoint-every=1 min-fit-clients=1 "
                   f"run-name='{name}'", stream=False, timeout=120)
    before = deployment.wait_for_results(name, lambda r: len(recorded(r)) >= 2, 600, "round 2")
    if finished(before):
        sys.exit(f"{name} ended before {node} could be killed")
    killed_after = max(recorded(before))
    restarts = deployment.crash(node)
    killed_at = time.monotonic()
    back = deployment.wait_restarted(node, restarts)
    results = deployment.wait_for_results(name, finished, rounds * ROUND_TIMEOUT, "the end")
    if results.get("stopped") or recorded(results) != list(range(1, rounds + 1)):
        sys.exit(f"{name} did not finish its {rounds} rounds: stopped={results.get('stopped')!r}, "
                 f"rounds {recorded(results)}")
    by_round = {r["round"]: r for r in results["rounds"]}
    rejoined = [r for r in range(killed_after + 2, rounds + 1) if 0 in by_round[r]["clients"]
                and not by_round[r]["rejected"]]
    last = by_round[rounds]
    if not rejoined or last["clients"] != list(range(NUM_NODES)) or last["rejected"]:
        sys.exit(f"{node}'s partition did not train again after its crash (in round {killed_after + 1}):\n"
                 + "\n".join(f"round {r}: clients {by_round[r]['clients']}, rejected {by_round[r]['rejected']}"
                              for r in sorted(by_round)))
    print(f"node fault: {node} crashed in round {killed_after + 1} (SIGKILL), running again "
          f"{back:.1f} s later (restart policy); round {killed_after + 1}: clients "
          f"{by_round[killed_after + 1]['clients']}, rejected {by_round[killed_after + 1]['rejected']}, "
          f"{by_round[killed_after + 1]['seconds']:.1f} s; partition 0 trained again from round {rejoined[0]}; "
          f"{rounds} rounds, finished {time.monotonic() - killed_at:.0f} s after the crash "
          f"({time.monotonic() - started:.0f} s in all)")


def serverapp_fault(home: Path, deployment: Deployment) -> None:
    """The ServerApp's SuperExec crashes after a checkpoint (and a ClientApp SuperExec is re-created):
    ``resume=true`` finishes the run, with the rounds of the same run made without faults."""
    name, reference, rounds = "serverapp-fault", "uninterrupted", 4
    config = f"method='fedproto' num-server-rounds={rounds} checkpoint-every=1"
    started = time.monotonic()
    flwr_run(home, f"{config} run-name='{name}'", stream=False, timeout=120)
    checkpoint = f"{RUNS}/{name}/checkpoint.npz"

    def checkpointed(results: dict[str, Any]) -> bool:
        return len(recorded(results)) >= 2 and deployment.exec("superexec-serverapp", "test", "-f",
                                                                 checkpoint).returncode == 0

    before = deployment.wait_for_results(name, checkpointed, 600, "round 2 and a checkpoint")
    if finished(before):
        sys.exit(f"{name} ended before superexec-serverapp could be killed")
    restarts = deployment.crash("superexec-serverapp")
    back = deployment.wait_restarted("superexec-serverapp", restarts)
    # a fresh container for partition 0's ClientApps: the state it continues from is on its volume only
    deployment("up", "-d", "--no-deps", "--force-recreate", "superexec-clientapp-1", timeout=300)
    listed = deployment.exec("superexec-clientapp-1", "ls", f"/app/client-state/{name}/partition-0")
    if not re.search(r"round-\d+\.\w+\.state", listed.stdout):
        sys.exit(f"the re-created superexec-clientapp-1 holds no state of {name} in /app/client-state:\n"
                 f"{listed.stdout}{listed.stderr}")
    interrupted = time.monotonic()
    output = flwr_run(home, f"{config} run-name='{name}' resume=true")
    resumed = deployment.results(name)
    if "resuming" not in output or not finished(resumed) or resumed.get("stopped"):
        sys.exit(f"{name} did not resume to its end (stopped={(resumed or {}).get('stopped')!r}):\n{output[-4000:]}")
    resumed_seconds = time.monotonic() - interrupted
    flwr_run(home, f"{config} run-name='{reference}'")
    whole = deployment.results(reference)
    got, want = rounds_without_timing(resumed), rounds_without_timing(whole)
    if not [r["round"] for r in got] == [r["round"] for r in want] == list(range(1, rounds + 1)):
        sys.exit(f"rounds {[r['round'] for r in got]} after the resume, {[r['round'] for r in want]} without faults")
    differences = [f"round {a['round']}: {key}: resumed {a.get(key)!r}, uninterrupted {b.get(key)!r}"
                   for a, b in zip(got, want) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    if differences:
        sys.exit(f"{name} (resumed) and {reference} differ:\n" + "\n".join(differences))
    print(f"ServerApp fault: superexec-serverapp crashed after round {max(recorded(before))} (checkpoint of round "
          f"{max(resumed['resumed_after'])}), running again {back:.1f} s later; superexec-clientapp-1 re-created; "
          f"resume=true finished the run in {resumed_seconds:.0f} s; its {rounds} rounds equal {reference}'s "
          f"but for {', '.join(sorted(TIMING_FIELDS))} ({time.monotonic() - started:.0f} s in all)")


def faults(home: Path, compose: list[str]) -> None:
    deployment = Deployment(compose)
    node_fault(home, deployment)
    serverapp_fault(home, deployment)


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
    addresses = unreachable_beyond_loopback(port)
    print(f"edge: {len(outsiders)} outsider requests refused before the SuperLink, the SuperLink unpublished; "
          f"the edge (SUPERLINK_PUBLIC_ADDRESS unset) refuses connections on this host's other addresses "
          f"{addresses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["register", "run", "attack", "faults"])
    parser.add_argument("--port", type=int, required=True, help="the port on 127.0.0.1 that flwr dials")
    parser.add_argument("--home", type=Path, required=True, help="a Flower home for the flwr CLI")
    parser.add_argument("--root-certificates", type=Path, help="the CA certificate (TLS variants)")
    parser.add_argument("--name", default="e2e", help="the run's name (its results directory)")
    parser.add_argument("--keys", nargs="+", default=[], help="register: the SuperNodes' public keys")
    parser.add_argument("--compose", default="", help="run, attack, faults: the docker-compose command of the project")
    parser.add_argument("--stranger", type=Path, help="attack: credentials of another CA (operator.crt/.key)")
    parser.add_argument("--flower-api", default="message", choices=["message", "legacy"],
                        help="run: the Flower front the run takes (the run config's flower-api)")
    args = parser.parse_args()
    home = native.cli_home(args.home, f"127.0.0.1:{args.port}", args.root_certificates)
    if args.action == "attack":
        attack(home, args.port, args.root_certificates, args.stranger, shlex.split(args.compose))
        return
    wait_until_ready(home)
    if args.action == "register":
        native.register_keys(home, [Path(key) for key in args.keys])
    elif args.action == "faults":
        faults(home, shlex.split(args.compose))
    else:
        run(home, args.name, shlex.split(args.compose), args.flower_api)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as failure:  # a failed check: its first line, marked for .ci/run's summary
        if isinstance(failure.code, str):
            print(f"compose-e2e: FAIL: {failure.code.splitlines()[0]}", file=sys.stderr, flush=True)
        raise
