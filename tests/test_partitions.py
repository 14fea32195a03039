"""Partition claims (federation/partitions): who holds what, checked against what the server knows."""

import time

import numpy as np
import pytest
from fakes import OK, FakeProxy
from flwr.common import GetPropertiesRes
from flwr.server import SimpleClientManager

from protofl.federation.partitions import DISCOVERY_ATTEMPTS, PartitionDiscovery, PartitionRegistry
from protofl.federation.server import ProxyNodes
from protofl.task.data import PartitionSizes


def properties(pid, n=4, train=30, test=10):
    return {"partition-id": pid, "num-partitions": n, "num-train": train, "num-test": test}


def registry_with(claims, num_partitions=0, expected=None):
    registry = PartitionRegistry(num_partitions, expected)
    for node, reply in claims.items():
        registry.record(node, reply)
    registry.freeze()
    return registry


def test_a_partition_claimed_by_two_live_nodes_goes_to_neither_until_one_leaves(caplog):
    registry = registry_with({"a": properties(0), "b": properties(1), "thief": properties(1)})
    assert registry.holders(["a", "b", "thief"]) == {0: "a"}
    assert "partition 1 is claimed by nodes b, thief: given to neither" in caplog.text
    assert registry.holders(["a", "b"]) == {0: "a", 1: "b"}  # the thief disconnected
    # a restarted node under a new id gets its partition back once the old id is gone
    registry.record("b-restarted", properties(1))
    assert registry.holders(["a", "b-restarted"]) == {0: "a", 1: "b-restarted"}


@pytest.mark.parametrize("reply, reason", [
    (properties(4), "partition-id 4 is outside [0, 4)"),
    (properties(2, n=1000), "reports num-partitions 1000, the run has 4"),
    (properties(True), "partition-id must be an integer >= 0, got True"),
    (properties(-1), "partition-id must be an integer >= 0, got -1"),
    (properties(1, train=0), "num-train must be an integer >= 1, got 0"),
    ({"partition-id": 1}, "num-partitions must be an integer >= 1, got None"),
    ("not a mapping", "properties must be a mapping, got str"),
    (properties(3) | {"state-round": -2}, "state-round must be an integer >= 0, got -2"),
    (properties(3) | {"state-round": "7"}, "state-round must be an integer >= 0, got '7'"),
])
def test_claims_outside_the_run_hold_nothing(reply, reason, caplog):
    registry = registry_with({"a": properties(0), "b": properties(1), "c": properties(2), "x": reply})
    assert registry.holders(["a", "b", "c", "x"]) == {0: "a", 1: "b", 2: "c"}
    assert reason in caplog.text


def test_the_number_of_partitions_is_the_run_configs_or_the_most_reported():
    claims = {"a": properties(0), "b": properties(1), "liar": properties(7, n=10**9)}
    assert registry_with(claims).num_partitions == 4
    assert registry_with(claims, num_partitions=4).holders(["a", "b", "liar"]) == {0: "a", 1: "b"}
    registry = registry_with({"a": properties(0, n=2), "b": properties(1, n=3)})  # a tie: the smaller
    assert registry.num_partitions == 2
    registry.record("c", properties(2, n=3))
    assert registry.num_partitions == 2  # fixed after the first discovery


def test_sizes_must_match_the_servers_copy_of_the_partition(caplog):
    def expected(n, pid):
        return PartitionSizes(np.array([20, 10], np.int64), 10)

    registry = registry_with({"a": properties(0), "big": properties(1, train=10**12)}, expected=expected)
    assert registry.holders(["a", "big"]) == {0: "a"}
    assert "reports 1000000000000 training and 10 test samples, but partition 1 has 30 and 10" in caplog.text


def test_a_node_whose_query_failed_is_asked_again_a_few_times():
    registry = PartitionRegistry()
    for attempt in range(DISCOVERY_ATTEMPTS):
        assert registry.to_query(["a", "b"]) == ["a", "b"] if attempt == 0 else ["b"]
        if attempt == 0:
            registry.record("a", properties(0))
        registry.record("b", TimeoutError("no answer"))
    assert registry.to_query(["a", "b"]) == []
    registry.record("bad", properties(True))
    assert registry.to_query(["bad"]) == []  # a malformed answer is not asked again


# --- discovery on a legacy client manager, without a Flower round ---------------------------------


class Node(FakeProxy):
    """A node that answers ``get_properties`` with ``reply`` (raised when it is an exception, after
    the whole ``timeout`` when it ``hangs``)."""

    def __init__(self, cid, reply, hangs=False):
        super().__init__(cid)
        self.reply, self.asked, self.hangs = reply, 0, hangs

    def get_properties(self, ins, timeout, group_id):
        self.asked += 1
        if self.hangs:
            time.sleep(timeout)  # as Flower's grid, which waits for the message's time to live
        if isinstance(self.reply, BaseException):
            raise self.reply
        return GetPropertiesRes(OK, self.reply)


def Manager(nodes):
    """The nodes on a legacy client manager, as the legacy front hands them to discovery."""
    manager = SimpleClientManager()
    for node in nodes:
        manager.register(node)
    return ProxyNodes(manager)


def test_discovery_finds_the_holders_and_asks_a_failed_node_again_next_round():
    nodes = [Node("a", properties(0, n=3)), Node("b", properties(1, n=3)), Node("c", TimeoutError("no answer"))]
    discovery = PartitionDiscovery(timeout=1.0)
    discovery.poll, discovery.start_timeout = 0.0, 1.0  # the first discovery waits for as many nodes as partitions
    discovery.discover(Manager(nodes))
    assert {pid: node.cid for pid, node in discovery.nodes.items()} == {0: "a", 1: "b"}
    assert discovery.registry.num_partitions == 3 and nodes[2].asked == DISCOVERY_ATTEMPTS
    assert discovery.known_sizes(1) == (30, 10, None)  # the holder's claim: no server copy of the data
    assert discovery.known_sizes(2) is None

    again = Node("c2", properties(2, n=3))  # c restarted under a new node id, and answers
    discovery.discover(Manager(nodes[:2] + [again]))
    assert sorted(discovery.nodes) == [0, 1, 2] and (nodes[0].asked, again.asked) == (1, 1)
    assert discovery.available(Manager(nodes[:1] + [again])) == [0, 2]  # b left


def test_a_node_that_never_answers_costs_a_timeout_in_a_few_rounds_at_most():
    hanging = Node("h", RuntimeError("Message contains an Error (reason: message expired)"), hangs=True)
    nodes = [Node("a", properties(0, n=2)), Node("b", properties(1, n=2)), hanging]
    discovery = PartitionDiscovery(timeout=0.3)
    started = time.monotonic()
    for _ in range(5):  # five rounds
        discovery.discover(Manager(nodes))
    # asked once in each of DISCOVERY_ATTEMPTS rounds, then never again: not 5 x the timeout
    assert hanging.asked == DISCOVERY_ATTEMPTS and time.monotonic() - started < 0.3 * (DISCOVERY_ATTEMPTS + 1.5)
    assert sorted(discovery.nodes) == [0, 1]


def test_a_node_whose_first_answer_came_too_late_holds_its_partition_from_a_later_round():
    """A node cold-starting under load (a ClientApp process started for the query) answered after
    the query's timeout: it was never asked again, and its partition sat out the rest of the run
    (the compose demo's resumed run, on a loaded machine, trained partition 1 alone)."""
    late = Node("c", TimeoutError("no reply within 0.3 s"), hangs=True)
    nodes = [Node("a", properties(0, n=3)), Node("b", properties(1, n=3)), late]
    discovery = PartitionDiscovery(timeout=0.3)
    discovery.poll, discovery.start_timeout = 0.0, 0.3
    discovery.discover(Manager(nodes))
    assert sorted(discovery.nodes) == [0, 1] and late.asked == 1  # once in a round, however long it waits
    late.reply, late.hangs = properties(2, n=3), False  # warm now
    discovery.discover(Manager(nodes))
    assert sorted(discovery.nodes) == [0, 1, 2] and late.asked == 2


def test_a_round_whose_nodes_all_answered_too_late_asks_them_again_before_it_gives_up():
    """Every ClientApp cold-starting on a loaded machine (a training worker started for the query)
    answered after the query's timeout: the round had no holder, and the run stopped in round 1,
    its nodes warm by then (a CI run of tests/test_simulation.py's training worker). A round with
    no holder asks its timed-out nodes again, while their attempts last."""

    class ColdNode(Node):
        def get_properties(self, ins, timeout, group_id):
            if self.asked == 0:
                self.asked = 1
                time.sleep(timeout)
                raise RuntimeError("Message Unavailable - it may have expired due to its TTL")
            return super().get_properties(ins, timeout, group_id)

    nodes = [ColdNode(cid, properties(pid, n=2)) for pid, cid in enumerate("ab")]
    discovery = PartitionDiscovery(timeout=0.3)
    discovery.poll, discovery.start_timeout = 0.0, 0.3
    discovery.discover(Manager(nodes))
    assert sorted(discovery.nodes) == [0, 1] and [node.asked for node in nodes] == [2, 2]

    hanging = [Node(cid, RuntimeError("message expired"), hangs=True) for cid in "cd"]
    discovery = PartitionDiscovery(timeout=0.2)
    discovery.poll, discovery.start_timeout = 0.0, 0.2
    started = time.monotonic()
    discovery.discover(Manager(hanging))  # nodes that never answer: DISCOVERY_ATTEMPTS timeouts, then no holder
    assert discovery.nodes == {} and [node.asked for node in hanging] == [DISCOVERY_ATTEMPTS] * 2
    assert time.monotonic() - started < 0.2 * (DISCOVERY_ATTEMPTS + 1.5)
