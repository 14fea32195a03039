"""Admission: every check a client's reply passes before the server rule sees it.

A reply is admitted only when it comes from a node asked this round, once; when its partition id
is the one that node holds, its sizes are that partition's (:mod:`protofl.federation.partitions`),
its losses finite, its parameters the shapes and dtypes the server sent (or a form the method
reads into them: ``parameter_spec``, ``parameter_from_wire``), its class statistics
well formed (:class:`~protofl.federation.wire.ClassStatistics`) and the method's named uploads
(``upload_specs``) each there, of their shape and dtype, finite and within the payload cap; and
when the method's own ``check_update`` accepts it. Then the round's magnitude screen
(:mod:`protofl.federation.screen`, ``screen-factor``) compares the updates with each other.
Whatever is wrong, the reply is dropped with a logged reason (a record for results.json's
``dropped``) and the others go on without it. After the server rule,
:func:`output_problem` keeps a non-finite or misshapen aggregate from going out.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from flwr.common.logger import log

from protofl.federation.partitions import KnownSizes
from protofl.federation.screen import screen_updates
from protofl.federation.wire import (
    COMPUTE,
    PARTITION_ID,
    TRAIN_LOSS,
    ArraySpec,
    ClassStatistics,
    PayloadError,
    Reply,
    checked_count,
    checked_loss,
    decode_array,
    decode_compute,
    decode_entry,
    rejection_reason,
)
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.typed_fields import Scalar, is_int
from protofl.task.models import client_architecture
from protofl.task.train import steps_per_epoch

DIVERGED_HINT = (
    "A non-finite train loss means local training diverged: lower lr, set max-grad-norm, "
    "keep partial-batch='drop' with BatchNorm models (docs/user-guide/training.md)"
)


@dataclass
class ClientUpdate:
    """One accepted fit result, decoded and checked."""

    partition_id: int
    num_examples: int
    parameters: list[np.ndarray]
    statistics: ClassStatistics | None
    metrics: dict[str, Scalar] = field(default_factory=dict)
    uploads: dict[str, np.ndarray] = field(default_factory=dict)  # the method's named arrays (upload_specs)


def stacked_statistics(updates: Sequence[ClientUpdate]) -> tuple[np.ndarray, np.ndarray]:
    """The updates' class statistics as (K x C x d means, K x C counts)."""
    return np.stack([u.statistics.means for u in updates]), np.stack([u.statistics.counts for u in updates])


class Admission:
    """The nodes asked this round, and the checks of their replies.

    ``references``: the shared model entries as the server built them (the shapes and dtypes every
    client's parameters must have); ``known_sizes(partition_id)``: what the server knows a
    partition holds; ``check_update``: the method's own checks; ``upload_specs()``: the method's
    named uploads and what each must be; ``parameter_spec(i, reference)`` and
    ``parameter_from_wire(i, array, reference)``: the forms shared entry ``i`` may travel in, and
    the entry read from one (default: the reference's shape and dtype, as it is).
    """

    def __init__(
        self,
        settings: ExperimentSettings,
        options: MethodOptions,
        references: list[np.ndarray],
        num_classes: int,
        feature_dim: int,
        loss_metrics: Sequence[str],
        known_sizes: KnownSizes,
        check_update: Callable[[ClientUpdate], None],
        upload_specs: Callable[[], Mapping[str, ArraySpec]] = dict,
        parameter_spec: Callable[[int, np.ndarray], ArraySpec | tuple[ArraySpec, ...]] = lambda _, r: ArraySpec.like(r),
        parameter_from_wire: Callable[[int, np.ndarray, np.ndarray], np.ndarray] = lambda _, a, r: a,
    ) -> None:
        self.settings, self.options, self.references = settings, options, references
        self.num_classes, self.feature_dim, self.loss_metrics = num_classes, feature_dim, loss_metrics
        self.known_sizes, self.check_update, self.upload_specs = known_sizes, check_update, upload_specs
        self.parameter_spec, self.parameter_from_wire = parameter_spec, parameter_from_wire
        self.max_payload_bytes = int(settings.max_payload_mb * 2**20)
        self.asked: dict[str, int] = {}  # node id -> partition, of this round's instructions
        self.server_round = 0  # the round whose replies are being checked (a method's check_update may read it)
        self.sent_parameters: list[np.ndarray] = list(references)  # what this round's clients train from

    def partitions(self, results: Sequence[tuple[Any, Reply]]) -> list[int]:
        """The partitions of the nodes asked this round that replied (whatever their replies hold)."""
        return sorted({self.asked[node.cid] for node, _ in results if node.cid in self.asked})

    def replies(
        self, server_round: int, stage: str, results: Sequence[tuple[Any, Reply]], parse: Callable
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each reply checked on its own: (``parse(partition_id, reply)`` of the good ones, what was
        dropped and why). A reply must come from a node asked this round, once, and be readable (a
        front that could not read it says why in its ``problem``); whatever else is wrong with it
        (``parse`` raises), the others go on without it."""
        accepted, dropped, seen = [], [], set()
        self.server_round = server_round
        for node, res in results:
            partition_id = None
            try:
                if node.cid not in self.asked:
                    raise PayloadError("this node was not asked this round")
                if node.cid in seen:
                    raise PayloadError("a second reply from this node this round")
                seen.add(node.cid)
                partition_id = self.asked[node.cid]
                if res.problem:
                    raise PayloadError(res.problem)
                accepted.append(parse(partition_id, res))
            except Exception as err:  # whatever a client sent, the round goes on without it
                dropped.append(drop(server_round, stage, node.cid, partition_id, err))
        return accepted, dropped

    def fit_update(self, partition_id: int, res: Reply) -> ClientUpdate:
        """A fit reply decoded and checked (raises :class:`PayloadError`)."""
        metrics = dict(res.metrics)
        pid = metrics.get(PARTITION_ID)
        if not is_int(pid) or pid != partition_id:
            raise PayloadError(f"partition-id {pid!r} is not the partition this node holds ({partition_id})")
        known = self.known_sizes(partition_id)
        checked_count(res.num_examples, "num_examples", 1)
        if known is not None and res.num_examples != known[0]:
            raise PayloadError(f"num_examples {res.num_examples} is not partition {partition_id}'s training size")
        checked_loss(metrics.get(TRAIN_LOSS), TRAIN_LOSS)
        for key in self.loss_metrics:  # loss values a client reports (when it does)
            value = metrics.get(key, 0.0)
            if not isinstance(value, float) or not 0.0 <= value < math.inf:
                raise PayloadError(f"{key} must be a finite float >= 0, got {value!r}")
        if len(res.parameters.tensors) != len(self.references):
            raise PayloadError(f"{len(res.parameters.tensors)} parameter arrays, expected {len(self.references)}")
        parameters: list[np.ndarray] = []
        for i, (tensor, reference) in enumerate(zip(res.parameters.tensors, self.references)):
            try:
                array = decode_array(tensor, self.parameter_spec(i, reference), self.max_payload_bytes)
                parameters.append(self.parameter_from_wire(i, array, reference))
            except PayloadError as err:
                raise PayloadError(f"parameter array {i}: {err}") from None
        statistics = None
        if self.options.statistics is not None:
            statistics = ClassStatistics.from_metrics(
                metrics, self.num_classes, self.options.statistics_dim(self.num_classes, self.feature_dim),
                res.num_examples, self.max_payload_bytes, expected_counts=known[2] if known else None,
            )
        uploads = {name: decode_entry(metrics, name, spec, self.max_payload_bytes)
                   for name, spec in self.upload_specs().items()}
        update = ClientUpdate(partition_id, res.num_examples, parameters, statistics, metrics, uploads)
        self.check_update(update)
        return update

    def screen(
        self, server_round: int, updates: list[ClientUpdate]
    ) -> tuple[list[ClientUpdate], list[dict[str, Any]], dict[str, float]]:
        """The round's magnitude screen (:mod:`protofl.federation.screen`, ``screen-factor``).
        Returns (kept, what was dropped, the largest ratio to its bound each kind reached: how close
        honest clients come to it)."""
        s = self.settings
        findings = screen_updates(
            updates, self.sent_parameters, {name: spec.scale for name, spec in self.upload_specs().items()},
            lambda partition: client_architecture(s.model, partition),
            lambda size: s.local_epochs * steps_per_epoch(size, s.batch_size, s.partial_batch), s.screen_factor,
        )
        node = {pid: cid for cid, pid in self.asked.items()}
        dropped = [drop(server_round, "screen", node[pid], pid, reason) for pid, reason in findings.reasons.items()]
        return [u for u in updates if u.partition_id not in findings.reasons], dropped, findings.ratios


def output_problem(
    parameters: list[np.ndarray] | None, references: Sequence[np.ndarray], broadcast: dict[str, np.ndarray]
) -> str | None:
    """Why the server rule's output must not go out (non-finite, wrong shape), or None:
    ``parameters`` against the ``references`` they replace, and the next round's ``broadcast``."""
    if parameters is not None:
        if len(parameters) != len(references):
            return f"the aggregate has {len(parameters)} arrays, expected {len(references)}"
        for i, (array, reference) in enumerate(zip(parameters, references)):
            if array.shape != reference.shape or array.dtype != reference.dtype:
                return f"aggregate array {i} is {array.dtype}{array.shape}, not {reference.dtype}{reference.shape}"
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                return f"aggregate array {i} is not finite"
    for name, array in broadcast.items():
        if np.asarray(array).dtype.kind == "f" and not np.isfinite(array).all():
            return f"the broadcast {name!r} is not finite"
    return None


def client_compute(updates: Sequence[ClientUpdate], asked: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """Partition id -> the node that replied for it (``asked``: node -> partition) and what its
    client says of how it computes (:func:`~protofl.federation.wire.decode_compute`'s fields)."""
    nodes = {partition: node for node, partition in asked.items()}
    return {str(u.partition_id): {"node": nodes.get(u.partition_id), **(decode_compute(u.metrics.get(COMPUTE)) or {})}
            for u in updates}


def drop(server_round: int, stage: str, node: str, partition_id: int | None, err: Any) -> dict[str, Any]:
    """A dropped reply, logged: its record in the round's ``dropped`` list."""
    reason = rejection_reason(err)
    log(WARNING, "round %d: dropped the %s result of node %s: %s", server_round, stage, node, reason)
    return {"stage": stage, "node": node, "partition": partition_id, "reason": reason}


def too_few_updates(
    server_round: int, usable: int, required: int, dropped: Sequence[str], failures: Sequence[str]
) -> str:
    """The reason a round ends the run: what happened to the updates (the commonest reasons, with
    counts) and a hint on what to change."""
    received = usable + len(dropped) + len(failures)
    parts = [f"round {server_round}: {usable} of {received} client updates usable, {required} required"]
    for label, reasons in (("dropped", dropped), ("failed", failures)):
        if reasons:
            common = Counter(reasons).most_common(3)
            listed = "; ".join(f"{reason} ({count})" for reason, count in common)
            more = len(set(reasons)) - len(common)
            parts.append(f"{len(reasons)} {label}: {listed}" + (f"; {more} other reasons" if more > 0 else ""))
    if any(TRAIN_LOSS in reason for reason in dropped):
        parts.append(DIVERGED_HINT)
    elif failures:
        parts.append("See the failed clients' logs")
    return ". ".join(parts)
