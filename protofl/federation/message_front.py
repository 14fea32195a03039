"""The Message-API front of the server template (:mod:`protofl.federation.server_core`): a
``flwr.serverapp.strategy.Strategy`` whose calls build and read Flower ``Message``\\ s
(:mod:`protofl.federation.message_records`), and whose :meth:`MessageStrategy.start` runs protofl's
rounds on a ``Grid``: checkpoints, resume, the results and the summary, as the legacy front's
server loop does. ``flower-api = "message"`` runs it; :func:`message_strategy` makes a method's
server rule one, which a Flower user can also hand to a ``ServerApp`` of their own::

    strategy = message_strategy(FedProtoStrategy)(settings, model, num_classes)
    strategy.start(grid)
"""

from __future__ import annotations

import functools
import time
from logging import INFO
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from protofl.federation.checkpoint import Checkpoint
from protofl.federation.message_records import CONFIG, instruction, ndarray_array, read_reply
from protofl.federation.server_core import ServerCore, rule_on_front
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import ClientFailed, Reply, client_error

__all__ = ["GridNodes", "MessageStrategy", "message_strategy"]


class GridNode:
    """A node of the grid, as the server template knows nodes (by ``cid``)."""

    def __init__(self, node_id: int) -> None:
        self.node_id, self.cid = node_id, str(node_id)


class GridNodes:
    """The grid's live nodes as the server template's :class:`~protofl.federation.partitions.Nodes`:
    a query is a ``query`` message."""

    poll = 1.0

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def all(self) -> dict[str, GridNode]:
        return {str(node_id): GridNode(node_id) for node_id in self.grid.get_node_ids()}

    def wait_for(self, num_nodes: int, timeout: int) -> bool:
        deadline = time.monotonic() + timeout
        while len(list(self.grid.get_node_ids())) < num_nodes:
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll)
        return True

    def properties(self, node: GridNode, query: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """The node's reply to a query message of ``query`` (a failed or missing reply raises)."""
        message = Message(RecordDict({CONFIG: ConfigRecord(dict(query))}), node.node_id, MessageType.QUERY)
        replies = list(self.grid.send_and_receive([message], timeout=timeout))
        if not replies:
            raise TimeoutError(f"no reply within {timeout} s")
        if replies[0].has_error():
            raise ClientFailed(client_error(str(replies[0].error.reason)))
        reply = read_reply(replies[0], [])
        if reply.problem:
            raise ValueError(reply.problem)
        return reply.properties


class MessageStrategy(ServerCore, Strategy):
    """The Message-API front of a server rule: the server template behind Flower's Message-API
    ``Strategy`` calls, whose rule hooks a method's :class:`ServerRule` fills in
    (:func:`message_strategy`). ``configure_*`` build one message per sampled node; ``aggregate_*``
    read the replies once each (:func:`~protofl.federation.message_records.read_reply`); a reply
    with an error is a failed message."""

    resumed: Checkpoint | None = None

    def resume_from(self, checkpoint: Checkpoint) -> None:
        super().resume_from(checkpoint)
        self.resumed = checkpoint

    def summary(self) -> None:
        log(INFO, "protofl: %s, the Message-API front", type(self).__name__)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        sent = [array.numpy() for array in arrays.values()]
        instructions = self.fit_instructions(server_round, GridNodes(grid), sent,
                                             sum(len(array.data) for array in arrays.values()))
        return [Message(instruction(arrays, dict(config) | c), node.node_id, MessageType.TRAIN)
                for node, c in instructions]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        results, failures = self.read_replies(replies)
        new_parameters, metrics = self.fit_results(server_round, results, failures)
        return None if new_parameters is None else self.parameters_record(new_parameters), MetricRecord(metrics)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return [Message(instruction(arrays, dict(config) | c), node.node_id, MessageType.EVALUATE)
                for node, c in self.evaluate_instructions(server_round, GridNodes(grid))]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        results, failures = self.read_replies(replies)
        loss, metrics = self.evaluate_results(server_round, results, failures)
        return MetricRecord(metrics | ({} if loss is None else {"loss": loss}))

    def read_replies(self, replies: Iterable[Message]) -> tuple[list[tuple[GridNode, Reply]], list[str]]:
        """(the replies, each read once, with the node that sent it; the failed messages' lines)."""
        results, failures = [], []
        for message in replies:
            node = GridNode(message.metadata.src_node_id)
            if message.has_error():
                failures.append(client_error(str(message.error.reason)))
            else:
                results.append((node, read_reply(message, self.shared_names)))
        return results, failures

    def parameters_record(self, parameters: list[np.ndarray]) -> ArrayRecord:
        """The shared entries as the ``arrays`` record, under their names in the model."""
        return ArrayRecord({name: ndarray_array(array) for name, array in zip(self.shared_names, parameters)})

    def entries_record(self, parameters: list[np.ndarray]) -> ArrayRecord:
        """The shared entries themselves, read from the forms they travel in (FedKD's factors), as
        the record a user's ``evaluate_fn`` and the run's ``Result`` get."""
        return self.parameters_record(self.parameters_from_wire(parameters))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """protofl's rounds on ``grid``: from the round after the checkpoint it resumes from, with a
        checkpoint after each complete round; the results, the summary and the trackers at the end,
        or once a round stops the run (:class:`RunStopped`: one error line, the reason in
        :attr:`stopped`). Defaults: the rule's initial parameters (``initial_arrays``), the run
        config's ``num-server-rounds`` and ``round-timeout``; ``train_config`` and
        ``evaluate_config`` go out with every instruction, under protofl's own keys."""
        result = Result()
        num_rounds = self.settings.num_server_rounds if num_rounds is None else num_rounds
        timeout = (self.settings.round_timeout or None) if timeout is None else timeout
        summary = self.run_rounds(lambda: self._rounds(grid, initial_arrays, num_rounds, timeout,
                                                       train_config or ConfigRecord(),
                                                       evaluate_config or ConfigRecord(), evaluate_fn, result))
        log(INFO, "[SUMMARY]")
        for line in summary.splitlines():
            log(INFO, "%s", line)
        return result

    def _rounds(self, grid: Grid, arrays: ArrayRecord | None, num_rounds: int, timeout: float | None,
                train_config: ConfigRecord, evaluate_config: ConfigRecord,
                evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None, result: Result) -> None:
        if self.resumed is not None:
            parameters, first = list(self.resumed.parameters), self.resumed.server_round + 1
        else:
            parameters, first = self.initial_parameters(), 1
        if arrays is None or self.resumed is not None:
            arrays = self.parameters_record(parameters)
        for server_round in range(first, num_rounds + 1):
            log(INFO, "[ROUND %s]", server_round)
            replies = grid.send_and_receive(self.configure_train(server_round, arrays, train_config, grid),
                                            timeout=timeout)
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            result.train_metrics_clientapp[server_round] = metrics
            parameters = [array.numpy() for array in arrays.values()]
            central = self.global_scores(server_round, parameters)
            if central is not None:
                result.evaluate_metrics_serverapp[server_round] = MetricRecord(central[1] | {"loss": central[0]})
            if evaluate_fn is not None:
                if (scores := evaluate_fn(server_round, self.entries_record(parameters))) is not None:
                    result.evaluate_metrics_serverapp[server_round] = scores
            messages = self.configure_evaluate(server_round, arrays, evaluate_config, grid)
            if messages:
                scored = self.aggregate_evaluate(server_round, grid.send_and_receive(messages, timeout=timeout))
                result.evaluate_metrics_clientapp[server_round] = scored
            self.recorder.track(server_round)  # the rounds before it, which are complete
            self.checkpoints.save(server_round, parameters, self.server_state)
        if result.arrays:
            result.arrays = self.entries_record([array.numpy() for array in result.arrays.values()])


@functools.cache
def message_strategy(rule: type[ServerRule]) -> type[MessageStrategy]:
    """The Flower Message-API ``Strategy`` of a method's server rule (a plain class), named as the
    rule is."""
    return rule_on_front(rule, MessageStrategy)
