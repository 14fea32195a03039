"""A real loopback deployment (SuperLink, SuperNodes and SuperExecs from docker-compose.yml's command
lines, as in test_deployment.py) with three SuperNodes, one of which runs a hostile ClientApp: the
run must finish on the two honest nodes, with the hostile update dropped in every round.

The hostile behaviour lives in tests/hostile/sitecustomize.py (test only): that directory goes on
PYTHONPATH of the third node's ClientApp SuperExec alone, and so of the flwr-clientapp processes it
starts. Each fit of that node trains honestly, then poisons its upload (``ATTACKS``, one set a round,
so that each defence is met on its own): round 1 sends class means x 1e6 as big-endian '>f4' and
claims 10**12 training examples with int64 class counts raised to add up to them; round 2 only the
scaled big-endian means (honest counts: the magnitude screen's case); round 3 all of that and names
partition 0 (an honest node's) as its own. Each hostile fit leaves a marker file, proof that the
patch ran in the process Flower started.
"""

import json
import re
from copy import deepcopy
from pathlib import Path

import native
import pytest

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_SITE = Path(__file__).resolve().parent / "hostile"
pytestmark = pytest.mark.slow

NUM_NODES = 3
HOSTILE_NODE = 3  # supernode-3 / superexec-clientapp-3 (partition 2)
HOSTILE_PARTITION = NUM_NODES - 1
ATTACKS = {1: {"scale", "inflate"}, 2: {"scale"}, 3: {"scale", "inflate", "lie"}}  # see tests/hostile
ROUNDS = len(ATTACKS)
RUN_TIMEOUT = 600
# the server's reason for dropping the hostile update, by round: the first check each attack meets
REASONS = {
    1: "num_examples 1000000000000 is not partition 2's training size",
    2: "vector norm",  # the magnitude screen (the big-endian arrays themselves are read as native ones)
    3: "partition-id 0 is not the partition this node holds (2)",
}


def three_node_compose() -> dict:
    """The compose topology with a third SuperNode and its ClientApp SuperExec, copied from the
    second with the next partition id and num-partitions=3 everywhere (as the compose file's
    header says to add a client)."""
    compose = native.load_compose()
    services = compose["services"]
    services[f"supernode-{NUM_NODES}"] = deepcopy(services["supernode-2"])
    services[f"superexec-clientapp-{NUM_NODES}"] = deepcopy(services["superexec-clientapp-2"])
    clientapp = services[f"superexec-clientapp-{NUM_NODES}"]["command"]
    clientapp[clientapp.index("supernode-2:9094")] = f"supernode-{NUM_NODES}:9094"
    for i in range(1, NUM_NODES + 1):
        command = services[f"supernode-{i}"]["command"]
        at = command.index("--node-config") + 1
        config, replaced = re.subn(r"num-partitions=\d+", f"num-partitions={NUM_NODES}", command[at])
        config, named = re.subn(r"partition-id=\d+", f"partition-id={i - 1}", config)
        assert replaced == named == 1, command[at]
        command[at] = config
    return compose


class HostileDeployment(native.NativeDeployment):
    """A NativeDeployment whose named services get extra environment variables."""

    def __init__(self, *args, extra_env: dict[str, dict[str, str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extra_env = extra_env

    def start(self, name, command, netns=None, env=None):
        return super().start(name, command, netns, dict(env or {}) | self.extra_env.get(name, {}))


@pytest.fixture
def deployment(tmp_path):
    env = native.environment()
    hostile_env = {
        "PYTHONPATH": f"{HOSTILE_SITE}{':' + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}",
        "HOSTILE_MARKER_DIR": str(tmp_path / "hostile-markers"),
        "HOSTILE_ATTACKS": ",".join(f"{r}:{'+'.join(sorted(names))}" for r, names in ATTACKS.items()),
        "HOSTILE_LIED_PARTITION": "0",
    }
    extra_env = {f"superexec-clientapp-{HOSTILE_NODE}": hostile_env}
    started = HostileDeployment(tmp_path / "services", env, extra_env=extra_env)
    yield started
    started.stop()
    for name, process in started.processes.items():
        assert process.poll() is not None, f"{name} still runs"


def test_run_finishes_without_the_hostile_node(tmp_path, deployment):
    link = ("127.0.0.1", native.free_port())
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NUM_NODES)]
    native.start_federation(deployment, three_node_compose(), link, nodes)
    home = native.cli_home(tmp_path / "cli-home", f"{link[0]}:{link[1]}")
    run_config = (f"method='fedproto' num-server-rounds={ROUNDS} min-fit-clients=2 fraction-fit=1.0 "
                  f"output-dir='{tmp_path}' run-name='hostile'")
    run = native.protofl_run(home, [str(ROOT), "deployment", "--run-config", run_config], timeout=RUN_TIMEOUT)
    # the ServerApp's log reaches us through --stream (its SuperExec's own log has only SuperExec lines)
    server_log = deployment.log("superexec-serverapp") + run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # the patch really ran: the hostile node poisoned its upload in every round, as scheduled
    markers = [json.loads(p.read_text()) for p in (tmp_path / "hostile-markers").glob("fit-round-*.json")]
    assert sorted(m["round"] for m in markers) == list(range(1, ROUNDS + 1)), markers
    for marker in markers:
        wanted = ATTACKS[marker["round"]]
        assert marker["own-partition"] == HOSTILE_PARTITION, marker
        assert ("class-means-scaled-big-endian" in marker["attacks"]) == ("scale" in wanted), marker
        inflated = marker["num-examples"] == 10**12
        assert ("num-examples-inflated" in marker["attacks"]) == inflated == ("inflate" in wanted)
        assert ("partition-id-lied" in marker["attacks"]) == (marker["sent-partition"] == 0) == ("lie" in wanted)

    results = json.loads((tmp_path / "hostile" / "results.json").read_text())
    stopped = results.get("stopped", "")
    for record in results["rounds"]:
        # the hostile node (partition 2) was asked to train, and its update, only it, was dropped
        assert HOSTILE_PARTITION in record["clients"], record
        assert record["rejected"] == 1, record
        (dropped,) = record["dropped"]
        assert dropped["partition"] == HOSTILE_PARTITION and REASONS[record["round"]] in dropped["reason"], dropped
    assert [r["round"] for r in results["rounds"]] == list(range(1, ROUNDS + 1)), stopped
    assert not stopped, stopped

    # honest learning went on
    last = results["rounds"][-1]
    assert last["personalized_accuracy"] > 0.5, last
    assert "Traceback" not in server_log, server_log[-5000:]
