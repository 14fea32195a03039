"""Which node holds which partition: the claims nodes make at discovery, checked.

Node ids are random per run, partitions are not, so the server asks each node for its properties:
its partition id, the federation's number of partitions, its training and test sizes. Each answer
is a claim, and a claim is only believed when it fits what the server knows:

- the answer must be well formed (integers, not booleans, in range); a malformed one refuses the
  node for the run;
- a node whose query failed, or that did not answer within the query's timeout (``round-timeout``,
  else ``DISCOVERY_TIMEOUT``), is asked again in the next rounds, at most ``DISCOVERY_ATTEMPTS``
  times in all and once a round: a node that hangs costs a timeout in a few rounds, and one whose
  first answer came late (a ClientApp cold-starting on a loaded machine) gets its partition back;
  a round in which no node holds a partition, and which cannot go on, asks its timed-out nodes
  again at once, while their attempts last;
- the number of partitions is the run config's ``num-partitions``, else the value most nodes report
  (ties: the smaller), fixed once the first discovery is done; a node that reports another value,
  or an id outside it, holds nothing;
- with ``verify-partitions`` the server rebuilds each partition from its own copy of the data set,
  and a node's sizes must be that partition's;
- a partition claimed by two live nodes is given to neither (logged) until one of them is gone: a
  node that restarts under a new node id gets its partition back once the old id has left.

:class:`PartitionDiscovery` runs the protocol on a front's :class:`Nodes` each round (the legacy
front's client manager, the Message API's grid); :class:`PartitionRegistry` holds the claims and
decides what to believe.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np
from flwr.common.logger import log

from protofl.federation.wire import (
    NUM_PARTITIONS,
    NUM_TEST,
    NUM_TRAIN,
    PARTITION_ID,
    STATE_ROUND,
    PayloadError,
    checked_count,
    describe_failure,
    rejection_reason,
)
from protofl.task.data import PartitionSizes

DISCOVERY_ATTEMPTS = 3
DISCOVERY_TIMEOUT = 120.0  # seconds a node has to answer, and the first discovery waits for all nodes

# (num_partitions, partition_id) -> the partition's sizes as the server's data gives them
ExpectedSizes = Callable[[int, int], PartitionSizes]
# partition_id -> (training size, test size, class counts or None), or None when nothing is known
KnownSizes = Callable[[int], "tuple[int, int, np.ndarray | None] | None"]


class Nodes(Protocol):
    """A federation's nodes as the server template sees them, whichever Flower front: the live
    ones by id (``all``, each node with its ``cid``), ``wait_for``, and a node's answer to a query
    (``properties``: its properties, else it raises: a failed or missing reply)."""

    def all(self) -> dict[str, Any]: ...

    def wait_for(self, num_nodes: int, timeout: int) -> bool: ...

    def properties(self, node: Any, query: Mapping[str, Any], timeout: float) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class PartitionClaim:
    """What a node says it holds."""

    partition_id: int
    num_partitions: int
    num_train: int
    num_test: int
    state_round: int | None = None  # the round of the newest state it holds for the run (None: not said)

    @classmethod
    def from_properties(cls, properties: Any) -> "PartitionClaim":
        if not isinstance(properties, Mapping):
            raise PayloadError(f"properties must be a mapping, got {type(properties).__name__}")
        state_round = properties.get(STATE_ROUND)
        return cls(*(
            checked_count(properties.get(key), key, minimum)
            for key, minimum in ((PARTITION_ID, 0), (NUM_PARTITIONS, 1), (NUM_TRAIN, 1), (NUM_TEST, 1))
        ), state_round=None if state_round is None else checked_count(state_round, STATE_ROUND))


class PartitionRegistry:
    """The claims of every node the server has asked, and who holds what among the live nodes."""

    def __init__(self, num_partitions: int = 0, expected: ExpectedSizes | None = None) -> None:
        self.fixed = num_partitions or None
        self.expected = expected
        self.claims: dict[str, PartitionClaim] = {}
        self.refused: dict[str, str] = {}
        self.failed: Counter[str] = Counter()
        self.failures: dict[str, str] = {}  # node -> its last failed query, in one line
        self.timed_out: set[str] = set()  # nodes whose query timed out in this round: not asked again in it
        self.warned: set[Any] = set()

    # --- discovery ----------------------------------------------------------------------------

    def to_query(self, node_ids: Iterable[str]) -> list[str]:
        """The nodes to ask: new ones, and those whose earlier queries failed (a few times at most,
        not again in a round in which one timed out)."""
        return [
            node for node in node_ids
            if node not in self.claims and node not in self.refused and self.failed[node] < DISCOVERY_ATTEMPTS
            and node not in self.timed_out
        ]

    def record(self, node_id: str, reply: Any, timed_out: bool = False) -> None:
        """A node's properties, or the exception its query raised (``timed_out``: after the whole
        timeout; such a node is not asked again this round)."""
        if isinstance(reply, BaseException):
            self.failed[node_id] += 1
            if timed_out:
                self.timed_out.add(node_id)
            self.failures[node_id] = rejection_reason(describe_failure(reply))
            again = "asked again next round" if self.failed[node_id] < DISCOVERY_ATTEMPTS else "not asked again"
            log(WARNING, "node %s did not report its partition (%s): %s", node_id, again, self.failures[node_id])
            return
        self.failures.pop(node_id, None)
        try:
            self.claims[node_id] = PartitionClaim.from_properties(reply)
        except PayloadError as err:
            self.refused[node_id] = rejection_reason(err)
            log(WARNING, "node %s holds no partition: %s", node_id, self.refused[node_id])

    @property
    def num_partitions(self) -> int | None:
        """The run config's value, else the value most nodes report (ties: the smaller)."""
        if self.fixed:
            return self.fixed
        reports = Counter(claim.num_partitions for claim in self.claims.values())
        return min(reports, key=lambda n: (-reports[n], n)) if reports else None

    def freeze(self) -> None:
        """Fix the number of partitions (after the first discovery)."""
        self.fixed = self.num_partitions

    # --- what is known of a partition ---------------------------------------------------------

    def sizes(self, partition_id: int) -> PartitionSizes | None:
        """The partition's sizes from the server's data (None without ``verify-partitions``)."""
        n = self.num_partitions
        return self.expected(n, partition_id) if self.expected is not None and n else None

    def problem(self, claim: PartitionClaim) -> str | None:
        """Why a claim is not believed, or None."""
        n = self.num_partitions
        if claim.num_partitions != n:
            return f"reports num-partitions {claim.num_partitions}, the run has {n}"
        if not claim.partition_id < n:
            return f"partition-id {claim.partition_id} is outside [0, {n})"
        sizes = self.sizes(claim.partition_id)
        if sizes is not None and (claim.num_train, claim.num_test) != (int(sizes.train_counts.sum()), sizes.num_test):
            return (
                f"reports {claim.num_train} training and {claim.num_test} test samples, but partition "
                f"{claim.partition_id} has {int(sizes.train_counts.sum())} and {sizes.num_test}"
            )
        return None

    def holders(self, live: Iterable[str]) -> dict[int, str]:
        """Partition id -> the one live node whose claim to it is believed."""
        claimants: dict[int, list[str]] = defaultdict(list)
        for node in sorted(live):
            claim = self.claims.get(node)
            if claim is None:
                continue
            problem = self.problem(claim)
            if problem is None:
                claimants[claim.partition_id].append(node)
            else:
                self._warn_once((node, problem), "node %s holds no partition: %s", node, problem)
        held = {}
        for pid, nodes in sorted(claimants.items()):
            if len(nodes) == 1:
                held[pid] = nodes[0]
            else:
                self._warn_once((pid, tuple(nodes)), "partition %d is claimed by nodes %s: given to neither "
                                "until only one of them is connected", pid, ", ".join(nodes))
        return held

    def _warn_once(self, key: Any, message: str, *args: Any) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log(WARNING, message, *args)


class PartitionDiscovery:
    """Which live node holds which partition, found by asking the nodes (:meth:`Nodes.properties`)."""

    poll = 1.0  # seconds between queries of newly listed nodes while partitions lack a holder

    def __init__(self, num_partitions: int = 0, expected: ExpectedSizes | None = None,
                 timeout: float = DISCOVERY_TIMEOUT, observe: Callable[[Any], None] | None = None) -> None:
        """``timeout``: seconds a node has to answer a query; ``observe``: called with each reply's properties."""
        self.observe = observe
        self.properties_timeout = timeout
        self.start_timeout = DISCOVERY_TIMEOUT  # how long the first discovery waits for every partition's node
        self.registry = PartitionRegistry(num_partitions, expected)
        self.nodes: dict[int, Any] = {}  # partition id -> the node holding it
        self.query: dict[str, Any] = {}  # the config of the properties query
        self.waited_for_all = False

    def discover(self, nodes: Nodes, query: Mapping[str, Any] | None = None) -> None:
        """Ask the nodes not asked yet (and those whose query failed) for their partition (``query``:
        the run's identity, for the state they hold); the first time, wait for as many nodes as the
        run has partitions, then fix that number. :attr:`nodes` becomes the believed holders among
        the live nodes."""
        self.query = dict(query or {})
        self.registry.timed_out.clear()  # a new round: a node that timed out before is asked again
        nodes.wait_for(1, timeout=int(self.start_timeout))
        self._query(nodes)
        while not self.registry.holders(nodes.all()) and self.registry.timed_out:
            # no holder at all: the round cannot go on, so the nodes that timed out (ClientApps
            # cold-starting on a loaded machine, warm by now) are asked again while attempts last
            self.registry.timed_out.clear()
            self._query(nodes)
        if not self.waited_for_all:
            self.waited_for_all = True
            deadline = time.monotonic() + self.start_timeout
            while self._waiting_for_nodes(nodes) and time.monotonic() < deadline:
                time.sleep(self.poll)
                self._query(nodes)
            self.registry.freeze()
        live = nodes.all()
        self.nodes = {pid: live[node] for pid, node in self.registry.holders(live).items()}

    def _waiting_for_nodes(self, nodes: Nodes) -> bool:
        """Whether partitions lack a holder while fewer nodes than partitions have answered: nodes
        still starting, or a restarted node (a new id) whose dead id is still listed (until its
        heartbeat lapses, up to 60 s) and fails its query."""
        expected = self.registry.num_partitions or 0
        live = nodes.all()
        answered = sum(node in self.registry.claims or node in self.registry.refused for node in live)
        return len(self.registry.holders(live)) < expected and answered < expected

    def _query(self, nodes: Nodes) -> None:
        live = nodes.all()
        asked = [live[node] for node in self.registry.to_query(live)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(asked)))) as pool:
            replies = list(pool.map(lambda node: _answer(nodes.properties, node, self.query, self.properties_timeout),
                                    asked))
        for node, (reply, seconds) in zip(asked, replies):
            failed = isinstance(reply, BaseException)
            if not failed and self.observe is not None:
                self.observe(reply)
            self.registry.record(node.cid, reply, timed_out=failed and seconds >= 0.9 * self.properties_timeout)

    def available(self, nodes: Nodes) -> list[int]:
        """The partitions whose holder is live, in order."""
        live = nodes.all()
        return sorted(pid for pid, node in self.nodes.items() if node.cid in live)

    def unavailable_reason(self, nodes: Nodes) -> str:
        """Why no live node holds a partition: how many nodes are connected and the commonest things
        their queries said (a failure's own line, a refusal, a claim not believed)."""
        live, registry = sorted(nodes.all()), self.registry
        if not live:
            return "No node is connected"
        said = Counter(
            registry.failures.get(node) or registry.refused.get(node)
            or (registry.problem(registry.claims[node]) if node in registry.claims else None)
            or ("its partition is claimed by another node too" if node in registry.claims else "no answer")
            for node in live
        )
        connected = f"{len(live)} node{'s' if len(live) > 1 else ''} connected: "
        return connected + "; ".join(f"{reason} ({count})" for reason, count in said.most_common(3))

    def state_rounds(self) -> dict[int, int | None]:
        """Partition id -> the round of the newest state its holder said it holds (None: not said)."""
        return {pid: getattr(self.registry.claims.get(node.cid), "state_round", None)
                for pid, node in self.nodes.items()}

    def known_sizes(self, partition_id: int) -> tuple[int, int, np.ndarray | None] | None:
        """(training size, test size, class counts or None) of a partition: from the server's data
        where it has them, else from its holder's claim; None when neither is known."""
        sizes = self.registry.sizes(partition_id)
        if sizes is not None:
            return int(sizes.train_counts.sum()), sizes.num_test, sizes.train_counts
        node = self.nodes.get(partition_id)
        claim = self.registry.claims.get(node.cid) if node is not None else None
        return (claim.num_train, claim.num_test, None) if claim is not None else None


def _answer(fn, *args) -> tuple[Any, float]:
    """(the reply, or the exception raised: a node that cannot answer is skipped, not fatal;
    the seconds it took)."""
    started = time.monotonic()
    try:
        reply = fn(*args)
    except Exception as err:
        reply = err
    return reply, time.monotonic() - started
