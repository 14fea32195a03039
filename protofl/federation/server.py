"""The server template: a Flower ``Strategy`` that a method fills in with hooks.

Per round: discover which node holds which partition (:mod:`protofl.federation.partitions`),
sample partitions with the run seed, send each the parameters the method shares, its seed and the
method's broadcast arrays; decode and check every fit result against what the server knows, screen
the magnitudes against the round's cohort, and hand the accepted updates, sorted by partition, to
the method's server rule; check the rule's output before anything goes out; score the global model
(GM) and aggregate the clients' evaluations (PM: by default carried by the next round's fit
replies, ``evaluation-message``); record everything.

Every client message is hostile until checked: nothing a client sends raises out of the strategy.
A bad update or evaluation is dropped with a logged reason, recorded in the round's ``dropped``
list of results.json; an aggregate that is not finite (or a server rule that fails) keeps the
previous global state, recorded as ``kept_previous``.

Hooks (see docs/adding-a-method.md):

- ``options_class``: the method's :class:`~protofl.settings.MethodOptions` (what it uploads and
  which model entries it shares are declared there);
- ``loss_metrics``: scalar losses its clients report, checked and averaged into the results;
- ``check_update(update)``: method-specific checks; raise :class:`PayloadError` to drop an update;
- ``broadcast(server_round)``: arrays sent to clients in the fit (and evaluate) config;
- ``aggregate_updates(server_round, updates)``: the server rule; returns the new global parameters
  (the shared entries, in order) or None; it averages parameters with :meth:`average_parameters`
  and passes :attr:`prototype_rule` to the class-vector math, so the run's robust rules apply;
- ``state_fields``: the attributes that hold the method's server state (restored when a round's
  output is rejected);
- ``broadcast_to_evaluate``: False keeps the broadcast out of the evaluate config.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from protofl.federation.checkpoint import Checkpoint
from protofl.federation.partitions import ExpectedSizes, PartitionRegistry
from protofl.federation.wire import (
    CORRECT,
    EVALUATE_ROUND,
    EVALUATED,
    PARTITION_ID,
    PM_L,
    PM_V,
    TRAIN_LOSS,
    ArraySpec,
    ClassStatistics,
    PayloadError,
    checked_count,
    checked_loss,
    decode_array,
    encode_array,
    parameters_bytes,
    payload_bytes,
    rejection_reason,
    round_config,
)
from protofl.report import RunRecorder, personalized_stats, progress_line
from protofl.settings import ExperimentSettings, MethodOptions, is_int, is_number
from protofl.task.models import MODEL_FAMILIES, SplitModel, client_architecture
from protofl.task.privacy import prototype_epsilon
from protofl.task.robust import lower_median, outliers, robust_average_layers
from protofl.task.sampling import client_seed, sample_partitions
from protofl.task.train import features_and_logits, head_loss_and_correct
from protofl.task.weights import set_weights


@dataclass
class ClientUpdate:
    """One accepted fit result, decoded and checked."""

    partition_id: int
    num_examples: int
    parameters: list[np.ndarray]
    statistics: ClassStatistics | None
    metrics: dict[str, Scalar] = field(default_factory=dict)


def stacked_statistics(updates: Sequence[ClientUpdate]) -> tuple[np.ndarray, np.ndarray]:
    """The updates' class statistics as (K x C x d means, K x C counts)."""
    return np.stack([u.statistics.means for u in updates]), np.stack([u.statistics.counts for u in updates])


def mean_client_metrics(updates: Sequence[ClientUpdate], keys: Sequence[str]) -> dict[str, float]:
    """Training-size-weighted mean of each metric over the clients that report it, keyed with "_"."""
    fields = {}
    for key in keys:
        reported = [(u.metrics[key], u.num_examples) for u in updates if key in u.metrics]
        if reported:
            values, weights = zip(*reported)
            fields[key.replace("-", "_")] = float(np.average(values, weights=weights))
    return fields


class RunStopped(Exception):
    """A round cannot go on: the run ends with this one-line reason, its results so far saved."""


DIVERGED_HINT = (
    "A non-finite train loss means local training diverged: lower lr, set max-grad-norm, "
    "keep partial-batch='drop' with BatchNorm models (README: 'Training and BatchNorm')"
)


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


class PrototypeStrategy(Strategy):
    """Flower Strategy with seeded sampling, payload checks, GM/PM evaluation and results."""

    options_class: type[MethodOptions] = MethodOptions
    loss_metrics: tuple[str, ...] = ()
    state_fields: tuple[str, ...] = ()
    broadcast_to_evaluate = True
    properties_timeout = 120.0
    discovery_poll = 1.0  # seconds between queries of newly listed nodes while partitions lack a holder

    def __init__(
        self,
        settings: ExperimentSettings,
        model: SplitModel,
        num_classes: int,
        global_test: tuple[torch.Tensor, torch.Tensor] | None = None,
        recorder: RunRecorder | None = None,
        partition_sizes: ExpectedSizes | None = None,
    ) -> None:
        """``partition_sizes``: each partition's sizes from the server's own copy of the data set,
        which the nodes' claims must match (``verify-partitions``)."""
        super().__init__()
        self.settings = settings
        self.options = self.options_class.from_settings(settings)
        self.model = model
        self.num_classes = num_classes
        self.feature_dim = model.feature_dim
        self.global_test = global_test
        self.max_payload_bytes = int(settings.max_payload_mb * 2**20)
        self.recorder = recorder or RunRecorder(settings.run_directory(), settings.as_dict())
        names = list(model.state_dict())
        self.initial_weights = [v.detach().cpu().numpy() for v in model.state_dict().values()]
        self.shared_indices = [i for i, name in enumerate(names) if self.options.shares(name)]
        self.has_global_model = len(self.shared_indices) == len(names)
        self.registry = PartitionRegistry(settings.num_partitions, partition_sizes)
        self.partitions: dict[int, ClientProxy] = {}  # partition id -> the node holding it
        self.waited_for_all = False
        self.sampled: list[int] = []
        self.asked: dict[str, int] = {}  # node id -> partition, of this round's instructions
        self.sent_parameters: list[np.ndarray] = self.shared_weights()  # what this round's clients train from
        self.releases: Counter[int] = Counter()  # rounds each partition released DP prototypes
        self.round_started = 0.0
        self.run_token = secrets.token_hex(8)  # names this run's client state; a resumed run keeps it
        self.checkpointed_round = 0
        self.pending_evaluation: int | None = None  # the round the next fit message's clients score

    # --- hooks for methods --------------------------------------------------------------

    def check_update(self, update: ClientUpdate) -> None:
        """Method-specific checks of a decoded update; raise :class:`PayloadError` to drop it."""

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to clients in the fit and evaluate config."""
        return {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        """Server rule: new global parameters (the shared entries), or None when none are shared."""
        raise NotImplementedError

    # --- helpers for server rules -------------------------------------------------------

    def average_parameters(
        self, updates: Sequence[ClientUpdate], weights: Sequence[float] | None = None
    ) -> list[np.ndarray]:
        """The clients' parameters under the run's ``aggregation`` rule: with ``method``, their
        layer-wise mean weighted by ``weights`` (default: the training sizes)."""
        weights = [u.num_examples for u in updates] if weights is None else weights
        s = self.settings
        return robust_average_layers(
            [u.parameters for u in updates], weights, s.aggregation, s.trim_fraction, self.sent_parameters
        )

    @property
    def prototype_rule(self) -> dict[str, Any]:
        """Keyword arguments that apply the run's ``prototype-aggregation`` rule to class vectors."""
        return {"rule": self.settings.prototype_aggregation, "trim_fraction": self.settings.trim_fraction}

    # --- what is exchanged ----------------------------------------------------------------

    def shared_weights(self) -> list[np.ndarray]:
        """Initial values of the model entries exchanged with clients, in order: sent in round 1,
        and the shapes and dtypes every client's parameters must have."""
        return [self.initial_weights[i] for i in self.shared_indices]

    # --- partitions and sampling --------------------------------------------------------

    def discover_partitions(self, client_manager: ClientManager) -> None:
        """Ask the nodes not asked yet (and those whose query failed) for their partition; the
        first time, wait for as many nodes as the run has partitions, then fix that number.
        ``self.partitions`` becomes the believed holders among the live nodes."""
        timeout = int(self.properties_timeout)
        client_manager.wait_for(1, timeout=timeout)
        self._query_nodes(client_manager)
        if not self.waited_for_all:
            self.waited_for_all = True
            deadline = time.monotonic() + timeout
            while self._waiting_for_nodes(client_manager) and time.monotonic() < deadline:
                time.sleep(self.discovery_poll)
                self._query_nodes(client_manager)
            self.registry.freeze()
        live = client_manager.all()
        self.partitions = {pid: live[node] for pid, node in self.registry.holders(live).items()}

    def _waiting_for_nodes(self, client_manager: ClientManager) -> bool:
        """Whether partitions lack a holder while fewer nodes than partitions have answered: nodes
        still starting, or a restarted node (a new id) whose dead id is still listed (until its
        heartbeat lapses, up to 60 s) and fails its query."""
        expected = self.registry.num_partitions or 0
        live = client_manager.all()
        answered = sum(node in self.registry.claims or node in self.registry.refused for node in live)
        return len(self.registry.holders(live)) < expected and answered < expected

    def _query_nodes(self, client_manager: ClientManager) -> None:
        live = client_manager.all()
        nodes = [live[node] for node in self.registry.to_query(live)]
        ins = GetPropertiesIns(config={})
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(nodes)))) as pool:
            replies = list(pool.map(lambda p: _try(p.get_properties, ins, self.properties_timeout, 0), nodes))
        for proxy, reply in zip(nodes, replies):
            self.registry.record(proxy.cid, reply if isinstance(reply, BaseException) else reply.properties)

    def _available_partitions(self, client_manager: ClientManager) -> list[int]:
        live = client_manager.all()
        return sorted(pid for pid, proxy in self.partitions.items() if proxy.cid in live)

    def _claimed_sizes(self, partition_id: int) -> tuple[int, int, np.ndarray | None] | None:
        """(training size, test size, class counts or None) of a partition: from the server's data
        where it has them, else from its holder's claim; None when neither is known."""
        sizes = self.registry.sizes(partition_id)
        if sizes is not None:
            return int(sizes.train_counts.sum()), sizes.num_test, sizes.train_counts
        proxy = self.partitions.get(partition_id)
        claim = self.registry.claims.get(proxy.cid) if proxy is not None else None
        return (claim.num_train, claim.num_test, None) if claim is not None else None

    # --- Strategy API: fit ------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        if self.settings.model in MODEL_FAMILIES and self.shared_weights():
            raise ValueError(
                f"model={self.settings.model!r} gives clients different architectures, but {self.settings.method} "
                "exchanges model parameters; use a single architecture, or a method that shares none (fedsa, "
                "fedproto without average-parameters)"
            )
        return ndarrays_to_parameters(self.shared_weights())

    def round_configs(
        self, server_round: int, partition_ids: Sequence[int], with_broadcast: bool = True
    ) -> list[dict[str, Scalar]]:
        """Per-client config: round, the client's seed, and the broadcast arrays (encoded once)."""
        arrays = self.broadcast(server_round) if with_broadcast else {}
        shared = {k: encode_array(v) for k, v in arrays.items()}
        checkpointed = self.checkpointed_round if self.settings.checkpoint_every else server_round - 1
        run = (self.recorder.directory.name, self.run_token, checkpointed)
        return [round_config(server_round, client_seed(self.settings.seed, server_round, p), *run) | shared
                for p in partition_ids]

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.discover_partitions(client_manager)
        self.round_started = time.perf_counter()  # after discovery, which also starts the clients
        available = self._available_partitions(client_manager)
        if not available:
            raise RunStopped(f"round {server_round}: no client reported a partition id; cannot sample clients")
        s = self.settings
        self.sampled = sample_partitions(available, s.fraction_fit, s.min_fit_clients, s.seed, server_round)
        self.asked = {self.partitions[p].cid: p for p in self.sampled}
        if parameters.tensors:
            self.sent_parameters = parameters_to_ndarrays(parameters)
        if s.dp_noise > 0 and self.options.statistics is not None:
            self.releases.update(self.sampled)
        configs = self.round_configs(server_round, self.sampled)
        if self.pending_evaluation is not None:  # score the previous round's model before training
            configs = [c | {EVALUATE_ROUND: self.pending_evaluation} for c in configs]
        instructions = [(self.partitions[p], FitIns(parameters, c)) for p, c in zip(self.sampled, configs)]
        self.recorder.update(
            server_round,
            bytes_down=sum(parameters_bytes(ins.parameters) + payload_bytes(ins.config) for _, ins in instructions),
            clients=self.sampled,
        )
        log(INFO, "round %d: training partitions %s", server_round, self.sampled)
        return instructions

    def _checked_replies(
        self, server_round: int, stage: str, results: Sequence[tuple[ClientProxy, Any]], parse: Any
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each reply checked on its own: (``parse(partition_id, reply)`` of the good ones, what was
        dropped and why). A reply must come from a node asked this round, once; whatever else is
        wrong with it (``parse`` raises), the others go on without it."""
        accepted, dropped, seen = [], [], set()
        for proxy, res in results:
            partition_id = None
            try:
                if proxy.cid not in self.asked:
                    raise PayloadError("this node was not asked this round")
                if proxy.cid in seen:
                    raise PayloadError("a second reply from this node this round")
                seen.add(proxy.cid)
                partition_id = self.asked[proxy.cid]
                accepted.append(parse(partition_id, res))
            except Exception as err:  # whatever a client sent, the round goes on without it
                dropped.append(self._drop(server_round, stage, proxy.cid, partition_id, err))
        return accepted, dropped

    def _parse_fit_result(self, partition_id: int, res: FitRes) -> ClientUpdate:
        metrics = dict(res.metrics)
        pid = metrics.get(PARTITION_ID)
        if not is_int(pid) or pid != partition_id:
            raise PayloadError(f"partition-id {pid!r} is not the partition this node holds ({partition_id})")
        known = self._claimed_sizes(partition_id)
        checked_count(res.num_examples, "num_examples", 1)
        if known is not None and res.num_examples != known[0]:
            raise PayloadError(f"num_examples {res.num_examples} is not partition {partition_id}'s training size")
        checked_loss(metrics.get(TRAIN_LOSS), TRAIN_LOSS)
        for key in self.loss_metrics:  # loss values a client reports (when it does)
            value = metrics.get(key, 0.0)
            if not isinstance(value, float) or not 0.0 <= value < math.inf:
                raise PayloadError(f"{key} must be a finite float >= 0, got {value!r}")
        references = self.shared_weights()
        if len(res.parameters.tensors) != len(references):
            raise PayloadError(f"{len(res.parameters.tensors)} parameter arrays, expected {len(references)}")
        parameters: list[np.ndarray] = []
        for i, (tensor, reference) in enumerate(zip(res.parameters.tensors, references)):
            spec = ArraySpec(reference.shape, (reference.dtype.name,))
            try:
                parameters.append(decode_array(tensor, spec, self.max_payload_bytes))
            except PayloadError as err:
                raise PayloadError(f"parameter array {i}: {err}") from None
        statistics = None
        if self.options.statistics is not None:
            statistics = ClassStatistics.from_metrics(
                metrics, self.num_classes, self.options.statistics_dim(self.num_classes, self.feature_dim),
                res.num_examples, self.max_payload_bytes, expected_counts=known[2] if known else None,
            )
        update = ClientUpdate(partition_id, res.num_examples, parameters, statistics, metrics)
        self.check_update(update)
        return update

    def _screen(self, updates: list[ClientUpdate]) -> tuple[list[ClientUpdate], dict[int, str], dict[str, float]]:
        """The default magnitude screen (``screen-factor``): an update whose parameter change, or
        one of whose class vectors, has a norm above the factor times the round's lower median
        (for class vectors: per class, among the clients of the same architecture) is dropped.
        Returns (kept, {partition: reason}, the largest ratios to the median seen: how close honest
        clients come to the bound)."""
        reasons: dict[int, str] = {}
        ratios: dict[str, float] = {}

        def compare(what: str, key: str, members: Sequence[int], norms: Sequence[float]) -> None:
            median = lower_median(norms)
            if median > 0:
                ratios[key] = max(ratios.get(key, 0.0), max(norms) / median)
            for k, norm, outlier in zip(members, norms, outliers(norms, self.settings.screen_factor)):
                if outlier:
                    reasons.setdefault(updates[k].partition_id, f"{what} norm {norm:.3g} is above "
                                       f"{self.settings.screen_factor:g} x the round's median {median:.3g}")

        if len(updates) < 2:
            return updates, reasons, ratios
        everyone = range(len(updates))
        if self.sent_parameters and updates[0].parameters:
            norms = [_change_norm(u.parameters, self.sent_parameters) for u in updates]
            compare("parameter change", "screen_parameter_ratio", everyone, norms)
        if updates[0].statistics is not None:  # per architecture: their feature scales differ
            means, counts = stacked_statistics(updates)
            row_norms = np.linalg.norm(means.astype(np.float64), axis=2)
            architecture = np.array([client_architecture(self.settings.model, u.partition_id) for u in updates])
            for name in np.unique(architecture):
                for c in range(means.shape[1]):
                    holders = np.flatnonzero((counts[:, c] > 0) & (architecture == name))
                    if len(holders) > 1:
                        compare(f"class {c} vector", "screen_prototype_ratio", holders, row_norms[holders, c])
        return [u for u in updates if u.partition_id not in reasons], reasons, ratios

    def _output_problem(self, server_round: int, parameters: list[np.ndarray] | None) -> str | None:
        """Why the server rule's output must not go out (non-finite, wrong shape), or None."""
        if parameters is not None:
            references = self.shared_weights()
            if len(parameters) != len(references):
                return f"the aggregate has {len(parameters)} arrays, expected {len(references)}"
            for i, (array, reference) in enumerate(zip(parameters, references)):
                if array.shape != reference.shape or array.dtype != reference.dtype:
                    return f"aggregate array {i} is {array.dtype}{array.shape}, not {reference.dtype}{reference.shape}"
                if array.dtype.kind == "f" and not np.isfinite(array).all():
                    return f"aggregate array {i} is not finite"
        for name, array in self.broadcast(server_round + 1).items():
            if np.asarray(array).dtype.kind == "f" and not np.isfinite(array).all():
                return f"the broadcast {name!r} is not finite"
        return None

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        failed = [_describe(failure) for failure in failures]
        for reason in failed:
            log(WARNING, "round %d: a client failed: %s", server_round, reason)
        if self.pending_evaluation is not None:
            self._record_evaluation(self.pending_evaluation, results, in_fit=True)
            self.pending_evaluation = None
        updates, dropped = self._checked_replies(server_round, "fit", results, self._parse_fit_result)
        updates, screened, ratios = self._screen(updates)
        for pid, reason in screened.items():
            dropped.append(self._drop(server_round, "screen", self.partitions[pid].cid, pid, reason))
        required = min(self.settings.min_fit_clients, len(self.sampled))
        if len(updates) < required:
            reasons = [d["reason"] for d in dropped]
            raise RunStopped(too_few_updates(server_round, len(updates), required, reasons, failed))
        updates.sort(key=lambda u: u.partition_id)  # arrival order must not change the float sums
        new_parameters, kept_previous = self._aggregate(server_round, updates)
        weights = [u.num_examples for u in updates]
        train_loss = float(np.average([u.metrics[TRAIN_LOSS] for u in updates], weights=weights))
        elapsed = time.perf_counter() - self.round_started
        privacy = {}
        if self.releases:
            privacy["dp_epsilon"] = prototype_epsilon(
                self.settings.dp_noise, max(self.releases.values()), self.settings.dp_delta
            )
        record = self.recorder.update(
            server_round,
            **mean_client_metrics(updates, self.loss_metrics),
            train_loss=train_loss,
            bytes_up=sum(_bytes_up(res) for _, res in results),
            rejected=len(results) - len(updates) + len(failures),
            dropped=dropped,
            **({"kept_previous": kept_previous} if kept_previous else {}),
            fit_seconds=elapsed,
            seconds=elapsed,
            **ratios,
            **privacy,
        )
        self.recorder.write()
        if not self.settings.is_eval_round(server_round):
            log(INFO, "round %d: %s", server_round, progress_line(record))
        metrics = {TRAIN_LOSS: train_loss, "accepted": len(updates)}
        if kept_previous and self.shared_indices:
            return None, metrics  # Flower keeps the parameters
        return ndarrays_to_parameters(new_parameters if new_parameters is not None else []), metrics

    def _aggregate(self, server_round: int, updates: list[ClientUpdate]) -> tuple[list[np.ndarray] | None, str | None]:
        """The server rule on the accepted updates, its output checked: (new parameters, None), or
        (None, why) with the method's state as before the round."""
        saved = {name: copy.deepcopy(getattr(self, name)) for name in self.state_fields}
        try:
            new_parameters = self.aggregate_updates(server_round, updates)
            problem = self._output_problem(server_round, new_parameters)
        except Exception as err:  # the rule must not end the run on what clients sent
            new_parameters, problem = None, f"the server rule failed: {type(err).__name__}: {err}"
        if problem is None:
            return new_parameters, None
        for name, value in saved.items():
            setattr(self, name, value)
        log(WARNING, "round %d: %s; the previous global state is kept", server_round, problem)
        return None, problem

    def _drop(self, server_round: int, stage: str, node: str, partition_id: int | None, err: Any) -> dict[str, Any]:
        reason = rejection_reason(err)
        log(WARNING, "round %d: dropped the %s result of node %s: %s", server_round, stage, node, reason)
        return {"stage": stage, "node": node, "partition": partition_id, "reason": reason}

    # --- checkpoints ------------------------------------------------------------------------

    def server_state(self) -> dict[str, Any]:
        """What a resumed run needs besides the parameters and the results: the method's
        ``state_fields``, the fixed number of partitions, the DP release counts, the round whose
        scores the next fit message asks for."""
        return {
            "fields": {name: getattr(self, name) for name in self.state_fields},
            "num_partitions": self.registry.num_partitions or 0,
            "releases": {str(pid): count for pid, count in self.releases.items()},
            "pending_evaluation": self.pending_evaluation,
        }

    def save_checkpoint(self, server_round: int, parameters: Parameters) -> None:
        """After a complete round: the run's checkpoint, every ``checkpoint-every`` rounds and after
        the last one; its time and size are recorded in the round."""
        every, last = self.settings.checkpoint_every, self.settings.num_server_rounds
        if not every or (server_round % every and server_round != last):
            return
        started = time.perf_counter()
        checkpoint = Checkpoint(server_round, parameters_to_ndarrays(parameters), self.server_state(),
                                self.recorder.results(), self.run_token)
        size = checkpoint.save(self.recorder.directory)
        self.checkpointed_round = server_round
        self.recorder.update(server_round, checkpoint_seconds=time.perf_counter() - started, checkpoint_bytes=size)
        self.recorder.write()

    def resume_from(self, checkpoint: Checkpoint) -> None:
        """Continue after ``checkpoint``'s round: its method state, partitions, results and run token."""
        state = checkpoint.strategy_state
        for name in self.state_fields:
            setattr(self, name, state["fields"][name])
        self.registry.fixed = int(state["num_partitions"]) or None
        self.releases = Counter({int(pid): int(count) for pid, count in state["releases"].items()})
        self.pending_evaluation = state.get("pending_evaluation")
        self.sent_parameters = list(checkpoint.parameters)
        self.run_token, self.checkpointed_round = checkpoint.run_token, checkpoint.server_round
        self.recorder.restore(checkpoint.results, resumed_after=checkpoint.server_round)
        log(INFO, "protofl: resuming %s after round %d", self.recorder.directory, checkpoint.server_round)

    # --- Strategy API: evaluation -------------------------------------------------------------

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """GM: the global model on the global test set (methods with a global model)."""
        if not self.has_global_model or self.global_test is None or not parameters.tensors:
            return None
        if server_round > 0 and not self.settings.is_eval_round(server_round):
            return None
        set_weights(self.model, parameters_to_ndarrays(parameters))
        x, y = self.global_test
        _, logits = features_and_logits(self.model.to(x.device), x)
        loss, correct = head_loss_and_correct(logits, y)
        accuracy = correct / len(y)
        if server_round > 0:
            self.recorder.update(
                server_round, global_accuracy=accuracy, global_loss=loss,
                seconds=time.perf_counter() - self.round_started,
            )
        return loss, {"global-accuracy": accuracy}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        if not self.settings.is_eval_round(server_round):
            return []
        if self.settings.evaluates_in_next_fit(server_round):
            self.pending_evaluation = server_round
            return []
        if self.settings.evaluate_clients == "all":
            chosen = self._available_partitions(client_manager)
        else:
            chosen = self.sampled
        self.asked = {self.partitions[p].cid: p for p in chosen}
        configs = self.round_configs(server_round, chosen, self.broadcast_to_evaluate)
        return [(self.partitions[p], EvaluateIns(parameters, c)) for p, c in zip(chosen, configs)]

    def _parse_evaluate_result(self, partition_id: int, res: EvaluateRes) -> tuple[int, EvaluateRes]:
        """An evaluation checked: its partition, its size (the partition's test size), a finite
        loss >= 0, counts of correct predictions within its size, PM(L)/PM(V) in [0, 1]."""
        metrics: Mapping[str, Any] = dict(res.metrics)
        if metrics.get(PARTITION_ID, partition_id) != partition_id:
            raise PayloadError(f"partition-id {metrics.get(PARTITION_ID)!r} is not this node's ({partition_id})")
        checked_count(res.num_examples, "num_examples", 1)
        known = self._claimed_sizes(partition_id)
        if known is not None and res.num_examples != known[1]:
            raise PayloadError(f"num_examples {res.num_examples} is not partition {partition_id}'s test size")
        checked_loss(res.loss, "loss")
        if CORRECT not in metrics:
            raise PayloadError(f"missing {CORRECT!r}")
        for key, value in metrics.items():
            if key.startswith(CORRECT) and not (is_int(value) and 0 <= value <= res.num_examples):
                raise PayloadError(f"{key} must be an integer in [0, {res.num_examples}], got {value!r}")
            if key in (PM_L, PM_V) and not (is_number(value) and 0.0 <= value <= 1.0):
                raise PayloadError(f"{key} must be a number in [0, 1], got {value!r}")
        return partition_id, res

    def _parse_embedded_evaluation(self, partition_id: int, res: FitRes) -> tuple[int, EvaluateRes]:
        """The evaluation a fit reply carries, checked as an evaluate reply."""
        return self._parse_evaluate_result(partition_id, embedded_evaluation(res))

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """PM: each client's own model on its local test split, aggregated across clients."""
        for failure in failures:
            log(WARNING, "round %d: a client failed to evaluate: %s", server_round, _describe(failure))
        return self._record_evaluation(server_round, results)

    def _record_evaluation(
        self, server_round: int, results: Sequence[tuple[ClientProxy, Any]], in_fit: bool = False
    ) -> tuple[float | None, dict[str, Scalar]]:
        """Check the evaluations of ``server_round``'s model, from evaluate replies or (``in_fit``)
        from the next round's fit replies, and record their PM fields in that round."""
        parse = self._parse_embedded_evaluation if in_fit else self._parse_evaluate_result
        checked, dropped = self._checked_replies(server_round, "evaluate", results, parse)
        valid = [res for _, res in sorted(checked, key=lambda pair: pair[0])]  # arrival order must not change sums
        fields = personalized_fields(valid)
        totals = [res.num_examples for res in valid]
        loss = float(np.average([res.loss for res in valid], weights=totals)) if valid else None
        previous = self.recorder.rounds.get(server_round, {}).get("dropped") or []
        timing = {} if in_fit else {"seconds": time.perf_counter() - self.round_started}
        record = self.recorder.update(
            server_round, personalized_loss=loss, **timing,
            **({"dropped": previous + dropped} if dropped else {}), **fields,
        )
        self.recorder.write()
        log(INFO, "round %d: %s", server_round, progress_line(record))
        return loss, {k: v for k, v in fields.items() if isinstance(v, float)}


def embedded_evaluation(res: FitRes) -> EvaluateRes:
    """The evaluation a fit reply carries (``EVALUATED`` keys) as an evaluate reply, unchecked:
    ``_parse_evaluate_result`` checks it like any other."""
    metrics = {k[len(EVALUATED):]: v for k, v in dict(res.metrics).items()
               if isinstance(k, str) and k.startswith(EVALUATED)}
    loss, num_examples = metrics.pop("loss", None), metrics.pop("num-examples", None)
    return EvaluateRes(Status(Code.OK, ""), loss, num_examples, metrics)


def personalized_fields(results: Sequence[EvaluateRes]) -> dict[str, Any]:
    """PM fields of a round from valid evaluation results: sample-weighted accuracy and its
    across-client statistics, each predictor's accuracy, and FedNH's PM(L) / PM(V); each over
    the results that report it."""
    fields: dict[str, Any] = {}
    for key in sorted({k for res in results for k in res.metrics if k.startswith(CORRECT)}):
        reporting = [res for res in results if key in res.metrics]
        correct = [int(res.metrics[key]) for res in reporting]
        stats = personalized_stats(correct, [res.num_examples for res in reporting])
        suffix = key[len(CORRECT):].replace("-", "_")
        if suffix:
            fields[f"personalized_accuracy{suffix}"] = stats["accuracy"]
        else:
            fields.update(
                personalized_accuracy=stats["accuracy"],
                personalized_accuracy_mean=stats["mean"],
                personalized_std=stats["std"],
                personalized_min=stats["min"],
                personalized_worst10=stats["worst10"],
            )
    for key in (PM_L, PM_V):  # unweighted over clients, as the paper
        values = [float(res.metrics[key]) for res in results if key in res.metrics]
        if values:
            name = key.replace("-", "_")
            fields.update({name: float(np.mean(values)), f"{name}_std": float(np.std(values))})
    return fields


def _change_norm(parameters: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """L2 norm of an update's change to the floating-point entries it trained from."""
    return math.sqrt(sum(
        float(np.sum((a.astype(np.float64) - r) ** 2)) for a, r in zip(parameters, reference) if r.dtype.kind == "f"
    ))


def _bytes_up(res: Any) -> int:
    try:
        return parameters_bytes(res.parameters) + payload_bytes(res.metrics)
    except Exception:  # a reply too malformed to measure counts nothing
        return 0


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # a node that cannot answer is skipped, not fatal
        return err


def _describe(failure: Any) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    _, res = failure
    return f"status {res.status.code}: {res.status.message}"
