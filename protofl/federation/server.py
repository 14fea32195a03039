"""The server template: a Flower ``Strategy`` that a method fills in with hooks.

Per round: discover which node holds which partition (once per node), sample partitions with the
run seed, send each the parameters the method shares, its seed and the method's broadcast arrays;
decode and check every fit result (a bad one is dropped with a logged reason, recorded as
``rejected``); hand the accepted updates, sorted by partition, to the method's server rule; score
the global model (GM) and aggregate the clients' evaluations (PM); record everything.

Hooks (see docs/adding-a-method.md):

- ``options_class``: the method's :class:`~protofl.settings.MethodOptions` (what it uploads and
  which model entries it shares are declared there);
- ``loss_metrics``: scalar losses its clients report, checked and averaged into the results;
- ``check_update(update)``: method-specific checks; raise :class:`PayloadError` to drop an update;
- ``broadcast(server_round)``: arrays sent to clients in the fit (and evaluate) config;
- ``aggregate_updates(server_round, updates)``: the server rule; returns the new global parameters
  (the shared entries, in order) or None;
- ``broadcast_to_evaluate``: False keeps the broadcast out of the evaluate config.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from protofl.federation.wire import (
    CORRECT,
    NUM_PARTITIONS,
    PARTITION_ID,
    PM_L,
    PM_V,
    TRAIN_LOSS,
    ArraySpec,
    ClassStatistics,
    PayloadError,
    decode_array,
    encode_array,
    parameters_bytes,
    payload_bytes,
    round_config,
)
from protofl.report import RunRecorder, personalized_stats, progress_line
from protofl.settings import ExperimentSettings, MethodOptions
from protofl.task.models import MODEL_FAMILIES, SplitModel
from protofl.task.sampling import client_seed, sample_partitions
from protofl.task.train import features_and_logits, head_loss_and_correct
from protofl.task.weights import set_weights, weighted_average


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


def average_parameters(updates: Sequence[ClientUpdate], by_sample_count: bool = True) -> list[np.ndarray]:
    """The clients' parameters averaged layer-wise, weighted by their training sizes or unweighted."""
    weights = [u.num_examples if by_sample_count else 1 for u in updates]
    return weighted_average([u.parameters for u in updates], weights)


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
    broadcast_to_evaluate = True
    properties_timeout = 120.0

    def __init__(
        self,
        settings: ExperimentSettings,
        model: SplitModel,
        num_classes: int,
        global_test: tuple[torch.Tensor, torch.Tensor] | None = None,
        recorder: RunRecorder | None = None,
    ) -> None:
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
        self.partitions: dict[int, ClientProxy] = {}  # partition id -> the node holding it
        self.num_partitions: int | None = None
        self.queried: set[str] = set()  # node ids already asked for their partition
        self.waited_for_all = False
        self.sampled: list[int] = []
        self.round_started = 0.0

    # --- hooks for methods --------------------------------------------------------------

    def check_update(self, update: ClientUpdate) -> None:
        """Method-specific checks of a decoded update; raise :class:`PayloadError` to drop it."""

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to clients in the fit and evaluate config."""
        return {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        """Server rule: new global parameters (the shared entries), or None when none are shared."""
        raise NotImplementedError

    # --- what is exchanged ----------------------------------------------------------------

    def shared_weights(self) -> list[np.ndarray]:
        """Initial values of the model entries exchanged with clients, in order: sent in round 1,
        and the shapes and dtypes every client's parameters must have."""
        return [self.initial_weights[i] for i in self.shared_indices]

    # --- partitions and sampling --------------------------------------------------------

    def discover_partitions(self, client_manager: ClientManager) -> None:
        """Learn which partition each node holds (node ids are random per run, partitions are not).

        Each node is asked once for its properties. The first time fewer nodes than the
        reported ``num-partitions`` are connected, wait for the rest (deployment), then go on
        with who is there.
        """
        timeout = int(self.properties_timeout)
        client_manager.wait_for(1, timeout=timeout)
        self._query_new_nodes(client_manager)
        if not self.waited_for_all and len(self.partitions) < (self.num_partitions or 0):
            self.waited_for_all = True
            client_manager.wait_for(self.num_partitions, timeout=timeout)
            self._query_new_nodes(client_manager)

    def _query_new_nodes(self, client_manager: ClientManager) -> None:
        new = [proxy for cid, proxy in client_manager.all().items() if cid not in self.queried]
        self.queried.update(proxy.cid for proxy in new)
        ins = GetPropertiesIns(config={})
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(new)))) as pool:
            replies = list(pool.map(lambda p: _try(p.get_properties, ins, self.properties_timeout, 0), new))
        for proxy, reply in zip(new, replies):
            if isinstance(reply, BaseException):
                log(WARNING, "node %s did not report its partition: %s", proxy.cid, reply)
                continue
            pid = reply.properties.get(PARTITION_ID)
            if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
                log(WARNING, "node %s reported an invalid partition-id %r", proxy.cid, pid)
            elif pid in self.partitions:
                log(WARNING, "node %s reported partition %d, already held by another node", proxy.cid, pid)
            else:
                self.partitions[pid] = proxy
                reported = reply.properties.get(NUM_PARTITIONS)
                if isinstance(reported, int):
                    self.num_partitions = max(self.num_partitions or 0, reported)

    def _available_partitions(self, client_manager: ClientManager) -> list[int]:
        live = client_manager.all()
        return sorted(pid for pid, proxy in self.partitions.items() if proxy.cid in live)

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
        return [round_config(server_round, client_seed(self.settings.seed, server_round, p)) | shared
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
        configs = self.round_configs(server_round, self.sampled)
        instructions = [(self.partitions[p], FitIns(parameters, c)) for p, c in zip(self.sampled, configs)]
        self.recorder.update(
            server_round,
            bytes_down=sum(parameters_bytes(ins.parameters) + payload_bytes(ins.config) for _, ins in instructions),
            clients=self.sampled,
        )
        log(INFO, "round %d: training partitions %s", server_round, self.sampled)
        return instructions

    def _parse_fit_result(self, proxy: ClientProxy, res: FitRes) -> ClientUpdate:
        metrics = dict(res.metrics)
        pid = metrics.get(PARTITION_ID)
        if not isinstance(pid, int) or pid not in self.partitions or self.partitions[pid].cid != proxy.cid:
            raise PayloadError(f"partition-id {pid!r} is not the partition this node reported")
        if not isinstance(res.num_examples, int) or res.num_examples < 1:
            raise PayloadError(f"num_examples must be a positive int, got {res.num_examples!r}")
        loss = metrics.get(TRAIN_LOSS)
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise PayloadError(f"train-loss must be a finite number, got {loss!r}")
        for key in self.loss_metrics:  # loss values a client reports (when it does)
            value = metrics.get(key, 0.0)
            if not isinstance(value, float) or not 0.0 <= value < math.inf:
                raise PayloadError(f"{key} must be a finite float >= 0, got {value!r}")
        references = self.shared_weights()
        if references and len(res.parameters.tensors) != len(references):
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
                res.num_examples, self.max_payload_bytes,
            )
        update = ClientUpdate(pid, res.num_examples, parameters, statistics, metrics)
        self.check_update(update)
        return update

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        failed = [_describe(failure) for failure in failures]
        for reason in failed:
            log(WARNING, "round %d: a client failed: %s", server_round, reason)
        updates: list[ClientUpdate] = []
        dropped: list[str] = []
        for proxy, res in results:
            try:
                updates.append(self._parse_fit_result(proxy, res))
            except PayloadError as err:
                log(WARNING, "round %d: dropped the update of node %s: %s", server_round, proxy.cid, err)
                dropped.append(str(err))
        required = min(self.settings.min_fit_clients, len(self.sampled))
        if len(updates) < required:
            raise RunStopped(too_few_updates(server_round, len(updates), required, dropped, failed))
        updates.sort(key=lambda u: u.partition_id)  # arrival order must not change the float sums
        new_parameters = self.aggregate_updates(server_round, updates)
        weights = [u.num_examples for u in updates]
        train_loss = float(np.average([u.metrics[TRAIN_LOSS] for u in updates], weights=weights))
        elapsed = time.perf_counter() - self.round_started
        record = self.recorder.update(
            server_round,
            **mean_client_metrics(updates, self.loss_metrics),
            train_loss=train_loss,
            bytes_up=sum(parameters_bytes(res.parameters) + payload_bytes(res.metrics) for _, res in results),
            rejected=len(results) - len(updates) + len(failures),
            fit_seconds=elapsed,
            seconds=elapsed,
        )
        self.recorder.write()
        if not self.settings.is_eval_round(server_round):
            log(INFO, "round %d: %s", server_round, progress_line(record))
        parameters = ndarrays_to_parameters(new_parameters if new_parameters is not None else [])
        return parameters, {TRAIN_LOSS: train_loss, "accepted": len(updates)}

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
        if self.settings.evaluate_clients == "all":
            chosen = self._available_partitions(client_manager)
        else:
            chosen = self.sampled
        configs = self.round_configs(server_round, chosen, self.broadcast_to_evaluate)
        return [(self.partitions[p], EvaluateIns(parameters, c)) for p, c in zip(chosen, configs)]

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """PM: each client's own model on its local test split, aggregated across clients."""
        for failure in failures:
            log(WARNING, "round %d: a client failed to evaluate: %s", server_round, _describe(failure))
        valid = [res for _, res in results if _valid_evaluation(res)]
        if len(valid) < len(results):
            log(WARNING, "round %d: ignored %d malformed evaluation results", server_round, len(results) - len(valid))
        fields = personalized_fields(valid)
        totals = [res.num_examples for res in valid]
        loss = float(np.average([res.loss for res in valid], weights=totals)) if valid else None
        record = self.recorder.update(
            server_round, personalized_loss=loss, seconds=time.perf_counter() - self.round_started, **fields
        )
        self.recorder.write()
        log(INFO, "round %d: %s", server_round, progress_line(record))
        return loss, {k: v for k, v in fields.items() if isinstance(v, float)}


def personalized_fields(results: Sequence[EvaluateRes]) -> dict[str, Any]:
    """PM fields of a round from valid evaluation results: sample-weighted accuracy and its
    across-client statistics, each predictor's accuracy, and FedNH's PM(L) / PM(V)."""
    totals = [res.num_examples for res in results]
    fields: dict[str, Any] = {}
    for key in sorted({k for res in results for k in res.metrics if k.startswith(CORRECT)}):
        if not all(key in res.metrics for res in results):
            continue
        stats = personalized_stats([int(res.metrics[key]) for res in results], totals)
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
        if results and all(key in res.metrics for res in results):
            values = [float(res.metrics[key]) for res in results]
            name = key.replace("-", "_")
            fields.update({name: float(np.mean(values)), f"{name}_std": float(np.std(values))})
    return fields


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


def _valid_evaluation(res: EvaluateRes) -> bool:
    if not isinstance(res.num_examples, int) or res.num_examples < 1:
        return False
    metrics: Mapping[str, Any] = res.metrics
    for key, value in metrics.items():
        if key.startswith(CORRECT) and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= res.num_examples
        ):
            return False
        if key in (PM_L, PM_V) and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            return False
    return math.isfinite(res.loss)
