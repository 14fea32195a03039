"""What every method shares: the payload codec, seeded client sampling, evaluation, results.

A method module subclasses :class:`PrototypeStrategy` (server rule) and
:class:`PrototypeClient` (client rule) and overrides only the hooks it needs:

server: ``has_global_model``, ``shared_weights()``, ``upload_spec()``, ``check_update()``,
``broadcast()``, ``aggregate_updates()``
client: ``fit()``, ``evaluate()`` (helpers for payloads, seeds and state are here)

Wire format (legacy Flower API): arrays travel as ``np.save(..., allow_pickle=False)`` bytes in
``FitRes.metrics`` (client -> server) and in ``FitIns.config`` / ``EvaluateIns.config``
(server -> client). Every blob a client sends is checked against an :class:`ArraySpec`; a client
whose upload fails a check is dropped from the round with a logged reason.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import time
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from flwr.client import NumPyClient
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
from flwr.server import History, Server
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from protofl.config import ExperimentConfig
from protofl.report import RunRecorder, class_weighted_accuracy, personalized_stats
from protofl.task.data import ClientData, load_global_test
from protofl.task.models import MODEL_FAMILIES, SplitModel
from protofl.task.train import (
    FeatureSums,
    class_means,
    features_and_logits,
    head_loss_and_correct,
    head_prediction,
    steps_per_epoch,
)

# ---------------------------------------------------------------------------------------
# Payload codec
# ---------------------------------------------------------------------------------------

ALLOWED_DTYPES = frozenset({"float32", "float64", "int32", "int64", "bool"})
NPY_MAGIC = b"\x93NUMPY"


class PayloadError(ValueError):
    """A payload that must not be used (unreadable, wrong shape or dtype, non-finite, too big)."""


@dataclass(frozen=True)
class ArraySpec:
    """What an array payload must look like. ``None`` in ``shape`` matches any length."""

    shape: tuple[int | None, ...]
    dtypes: tuple[str, ...] = ("float32",)
    nonnegative: bool = False


def encode_array(array: np.ndarray) -> bytes:
    """numpy array -> ``.npy`` bytes (never pickled)."""
    array = np.ascontiguousarray(array)
    if array.dtype.name not in ALLOWED_DTYPES:
        raise PayloadError(f"dtype {array.dtype} is not allowed on the wire")
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def decode_array(blob: Any, spec: ArraySpec, max_bytes: int) -> np.ndarray:
    """``.npy`` bytes -> array, checked against ``spec``; raises :class:`PayloadError`."""
    if not isinstance(blob, bytes):
        raise PayloadError(f"expected bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise PayloadError(f"{len(blob)} bytes exceeds the cap of {max_bytes}")
    if not blob.startswith(NPY_MAGIC):
        raise PayloadError("not a .npy array")
    # Check the header before loading: a header may claim any shape, and loading allocates it.
    stream = io.BytesIO(blob)
    try:
        major, _ = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(stream)
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise PayloadError(f"unreadable array header ({err})") from None
    if dtype.name not in spec.dtypes:
        raise PayloadError(f"dtype {dtype} not in {spec.dtypes}")
    if len(shape) != len(spec.shape) or any(want is not None and want != got for want, got in zip(spec.shape, shape)):
        raise PayloadError(f"shape {shape} does not match {spec.shape}")
    if len(blob) - stream.tell() != math.prod(shape) * dtype.itemsize:
        raise PayloadError(f"data size does not match the header's shape {shape}")
    try:
        array = np.load(io.BytesIO(blob), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise PayloadError(f"unreadable array ({err})") from None
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise PayloadError("non-finite values")
    if spec.nonnegative and (array < 0).any():
        raise PayloadError("negative values")
    return array


def payload_bytes(values: Mapping[str, Any]) -> int:
    """Bytes carried by the ``bytes`` values of a config/metrics dict."""
    return sum(len(v) for v in values.values() if isinstance(v, bytes))


def parameters_bytes(parameters: Parameters) -> int:
    return sum(len(t) for t in parameters.tensors)


# ---------------------------------------------------------------------------------------
# Seeded sampling and aggregation helpers
# ---------------------------------------------------------------------------------------


def sample_partitions(
    partition_ids: Sequence[int], fraction: float, min_clients: int, seed: int, server_round: int
) -> list[int]:
    """The partition ids trained this round: depends only on (ids, fraction, seed, round)."""
    ids = sorted(partition_ids)
    count = min(len(ids), max(min_clients, int(fraction * len(ids))))
    rng = np.random.default_rng([seed, server_round])
    return sorted(int(i) for i in rng.choice(ids, size=count, replace=False))


def client_seed(seed: int, server_round: int, partition_id: int) -> int:
    """Seed for one client's local work in one round."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def weighted_average(
    arrays_per_client: Sequence[Sequence[np.ndarray]], weights: Sequence[float]
) -> list[np.ndarray]:
    """Layer-wise weighted mean; each result keeps its layer's dtype."""
    w = np.asarray(weights, dtype=np.float64)
    if len(arrays_per_client) == 0 or w.sum() <= 0:
        raise ValueError("nothing to average")
    w = w / w.sum()
    return [
        np.tensordot(w, np.stack([client[i] for client in arrays_per_client]).astype(np.float64), axes=1)
        .astype(arrays_per_client[0][i].dtype)
        for i in range(len(arrays_per_client[0]))
    ]


# ---------------------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------------------


@dataclass
class ClientUpdate:
    """One accepted fit result, decoded and validated."""

    partition_id: int
    num_examples: int
    parameters: list[np.ndarray]
    payload: dict[str, np.ndarray]
    metrics: dict[str, Scalar] = field(default_factory=dict)


def check_class_counts(update: ClientUpdate) -> None:
    """The uploaded class counts must add up to the client's training size."""
    if int(update.payload["class-counts"].sum()) != update.num_examples:
        raise PayloadError("class counts do not add up to num_examples")


def check_loss_metrics(update: ClientUpdate, keys: Sequence[str]) -> None:
    """Loss values a client reports (when it does) must be finite floats >= 0."""
    for key in keys:
        loss = update.metrics.get(key, 0.0)
        if not isinstance(loss, float) or not 0.0 <= loss < math.inf:
            raise PayloadError(f"{key} must be a finite float >= 0, got {loss!r}")


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


PROTOTYPE_WEIGHTINGS = ("count", "uniform")
# where local prototypes come from: an eval pass after training, or the features seen in
# training (every epoch, or the last one)
PROTOTYPE_PASSES = ("post-eval", "during-train", "last-epoch")


def aggregate_prototypes(
    prototypes: np.ndarray, counts: np.ndarray, weighting: str = "count"
) -> tuple[np.ndarray, np.ndarray]:
    """K x C x d client prototypes and K x C counts -> (C x d global prototypes, C mask).

    Class c's global prototype is the mean of the clients' prototypes of c weighted by their
    counts of c (``count``) or unweighted over the clients holding c (``uniform``). The mask
    marks classes held by at least one client; their rows are zero otherwise.
    """
    if weighting not in PROTOTYPE_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {PROTOTYPE_WEIGHTINGS}, got {weighting!r}")
    held = counts > 0
    weights = counts.astype(np.float64) if weighting == "count" else held.astype(np.float64)
    total = weights.sum(axis=0)
    summed = np.einsum("kc,kcd->cd", weights, prototypes.astype(np.float64))
    mask = total > 0
    global_prototypes = np.zeros(prototypes.shape[1:], dtype=np.float32)
    global_prototypes[mask] = summed[mask] / total[mask, None]
    return global_prototypes, mask


def prototype_broadcast(prototypes: np.ndarray | None, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """Global prototypes (C x d) and their class mask as broadcast arrays; read back by
    :meth:`PrototypeClient.global_prototypes`. Empty before the server has any."""
    if prototypes is None:
        return {}
    return {"global-prototypes": prototypes, "global-prototype-mask": mask}


class PrototypeStrategy(Strategy):
    """Flower Strategy with seeded sampling, payload validation, GM/PM evaluation and results.

    Subclasses set ``has_global_model`` and override ``upload_spec``, ``broadcast`` and
    ``aggregate_updates``.
    """

    has_global_model = True
    broadcast_to_evaluate = True  # False: the broadcast arrays go in the fit config only
    properties_timeout = 120.0

    def __init__(
        self,
        config: ExperimentConfig,
        model: SplitModel,
        num_classes: int,
        global_test: tuple[torch.Tensor, torch.Tensor] | None = None,
        recorder: RunRecorder | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.num_classes = num_classes
        self.feature_dim = model.feature_dim
        self.global_test = global_test
        self.max_payload_bytes = int(config.max_payload_mb * 2**20)
        self.recorder = recorder or RunRecorder(config.run_directory(), config.as_dict())
        self.initial_weights = [v.detach().cpu().numpy() for v in model.state_dict().values()]
        self.partitions: dict[int, ClientProxy] = {}  # partition id -> the node holding it
        self.num_partitions: int | None = None
        self.queried: set[str] = set()  # node ids already asked for their partition
        self.waited_for_all = False
        self.sampled: list[int] = []
        self.round_started = 0.0

    # --- hooks for methods --------------------------------------------------------------

    def shared_weights(self) -> list[np.ndarray]:
        """Initial values of the model arrays exchanged with clients, in order: sent in round 1 and
        the shapes every client's fit result must have (the whole model, or none)."""
        return self.initial_weights if self.has_global_model else []

    def upload_spec(self) -> dict[str, ArraySpec]:
        """Arrays each client must send in its fit metrics (key -> spec)."""
        return {}

    def class_statistics_spec(self, means_key: str) -> dict[str, ArraySpec]:
        """Upload spec of per-class mean features (C x d, under ``means_key``) and class counts."""
        return {
            means_key: ArraySpec((self.num_classes, self.feature_dim)),
            "class-counts": ArraySpec((self.num_classes,), ("int64",), nonnegative=True),
        }

    def check_update(self, update: ClientUpdate) -> None:
        """Method-specific checks of a decoded update; raise :class:`PayloadError` to drop it."""

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        """Arrays sent to clients in the fit and evaluate config."""
        return {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        """Server rule: new global parameters (None for methods without a global model)."""
        raise NotImplementedError

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
            pid = reply.properties.get("partition-id")
            if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
                log(WARNING, "node %s reported an invalid partition-id %r", proxy.cid, pid)
            elif pid in self.partitions:
                log(WARNING, "node %s reported partition %d, already held by another node", proxy.cid, pid)
            else:
                self.partitions[pid] = proxy
                reported = reply.properties.get("num-partitions")
                if isinstance(reported, int):
                    self.num_partitions = max(self.num_partitions or 0, reported)

    def _available_partitions(self, client_manager: ClientManager) -> list[int]:
        live = client_manager.all()
        return sorted(pid for pid, proxy in self.partitions.items() if proxy.cid in live)

    # --- Strategy API ---------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        if self.config.model in MODEL_FAMILIES and self.shared_weights():
            raise ValueError(
                f"model={self.config.model!r} gives clients different architectures, but {self.config.method} "
                "exchanges model parameters; use a single architecture, or a method that shares none (fedsa, "
                "fedproto without average-parameters)"
            )
        return ndarrays_to_parameters(self.shared_weights())

    def _configs(
        self, server_round: int, partition_ids: Sequence[int], with_broadcast: bool = True
    ) -> list[dict[str, Scalar]]:
        """Per-client config: round, the client's seed, and the broadcast arrays (encoded once)."""
        arrays = self.broadcast(server_round) if with_broadcast else {}
        shared = {k: encode_array(v) for k, v in arrays.items()}
        return [
            {"server-round": server_round, "seed": client_seed(self.config.seed, server_round, p), **shared}
            for p in partition_ids
        ]

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.discover_partitions(client_manager)
        self.round_started = time.perf_counter()  # after discovery, which also starts the clients
        available = self._available_partitions(client_manager)
        if not available:
            raise RuntimeError("no client reported a partition id; cannot sample clients")
        self.sampled = sample_partitions(
            available, self.config.fraction_fit, self.config.min_fit_clients, self.config.seed, server_round
        )
        configs = self._configs(server_round, self.sampled)
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
        pid = metrics.get("partition-id")
        if not isinstance(pid, int) or pid not in self.partitions or self.partitions[pid].cid != proxy.cid:
            raise PayloadError(f"partition-id {pid!r} is not the partition this node reported")
        if not isinstance(res.num_examples, int) or res.num_examples < 1:
            raise PayloadError(f"num_examples must be a positive int, got {res.num_examples!r}")
        loss = metrics.get("train-loss")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise PayloadError(f"train-loss must be a finite number, got {loss!r}")
        parameters: list[np.ndarray] = []
        references = self.shared_weights()
        if references and len(res.parameters.tensors) != len(references):
            raise PayloadError(f"{len(res.parameters.tensors)} parameter arrays, expected {len(references)}")
        for i, (tensor, reference) in enumerate(zip(res.parameters.tensors, references)):
            spec = ArraySpec(reference.shape, (reference.dtype.name,))
            try:
                parameters.append(decode_array(tensor, spec, self.max_payload_bytes))
            except PayloadError as err:
                raise PayloadError(f"parameter array {i}: {err}") from None
        payload = {}
        for key, spec in self.upload_spec().items():
            if key not in metrics:
                raise PayloadError(f"missing {key!r}")
            try:
                payload[key] = decode_array(metrics[key], spec, self.max_payload_bytes)
            except PayloadError as err:
                raise PayloadError(f"{key!r}: {err}") from None
        update = ClientUpdate(pid, res.num_examples, parameters, payload, metrics)
        self.check_update(update)
        return update

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        for failure in failures:
            log(WARNING, "round %d: a client failed: %s", server_round, _describe(failure))
        updates: list[ClientUpdate] = []
        for proxy, res in results:
            try:
                updates.append(self._parse_fit_result(proxy, res))
            except PayloadError as err:
                log(WARNING, "round %d: dropped the update of node %s: %s", server_round, proxy.cid, err)
        required = min(self.config.min_fit_clients, len(self.sampled))
        if len(updates) < required:
            raise RuntimeError(
                f"round {server_round}: only {len(updates)} valid client updates, "
                f"{required} required (min-fit-clients); see the warnings above"
            )
        updates.sort(key=lambda u: u.partition_id)  # arrival order must not change the float sums
        new_parameters = self.aggregate_updates(server_round, updates)
        weights = [u.num_examples for u in updates]
        train_loss = float(np.average([u.metrics["train-loss"] for u in updates], weights=weights))
        elapsed = time.perf_counter() - self.round_started
        record = self.recorder.update(
            server_round,
            train_loss=train_loss,
            bytes_up=sum(parameters_bytes(res.parameters) + payload_bytes(res.metrics) for _, res in results),
            rejected=len(results) - len(updates) + len(failures),
            fit_seconds=elapsed,
            seconds=elapsed,
        )
        self.recorder.write()
        if not self.config.is_eval_round(server_round):
            log(INFO, "round %d: %s", server_round, _progress(record))
        parameters = ndarrays_to_parameters(new_parameters if new_parameters is not None else [])
        return parameters, {"train-loss": train_loss, "accepted": len(updates)}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """GM: the global model on the global test set (methods with a global model)."""
        if not self.has_global_model or self.global_test is None or not parameters.tensors:
            return None
        if server_round > 0 and not self.config.is_eval_round(server_round):
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
        if not self.config.is_eval_round(server_round):
            return []
        if self.config.evaluate_clients == "all":
            chosen = self._available_partitions(client_manager)
        else:
            chosen = self.sampled
        configs = self._configs(server_round, chosen, self.broadcast_to_evaluate)
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
        totals = [res.num_examples for res in valid]
        fields: dict[str, Any] = {}
        for key in sorted({k for res in valid for k in res.metrics if k.startswith("correct")}):
            if not all(key in res.metrics for res in valid):
                continue
            stats = personalized_stats([int(res.metrics[key]) for res in valid], totals)
            suffix = key[len("correct"):].replace("-", "_")
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
        for key in ("pm-l", "pm-v"):  # FedNH's PM(L) / PM(V): unweighted over clients, as the paper
            if valid and all(key in res.metrics for res in valid):
                values = [float(res.metrics[key]) for res in valid]
                name = key.replace("-", "_")
                fields.update({name: float(np.mean(values)), f"{name}_std": float(np.std(values))})
        loss = float(np.average([res.loss for res in valid], weights=totals)) if valid else None
        record = self.recorder.update(
            server_round, personalized_loss=loss, seconds=time.perf_counter() - self.round_started, **fields
        )
        self.recorder.write()
        log(INFO, "round %d: %s", server_round, _progress(record))
        return loss, {k: v for k, v in fields.items() if isinstance(v, float)}

    def finish(self) -> str:
        """Write the final files; returns the run summary (ends with where the files are)."""
        results = self.recorder.write(plot=True)
        lines = [
            f"{key}: final {s['final']:.4f} | best {s['best']:.4f} (round {s['best_round']}) "
            f"| last-10 mean {s['last10_mean']:.4f}"
            for key, s in results["summary"].items()
            if s
        ]
        lines.append(f"results written to {self.recorder.directory}")
        return "\n".join(lines)


class RunSummary(History):
    """Flower's History, printed in the [SUMMARY] log as protofl's summary instead of every metric."""

    summary = ""

    def __str__(self) -> str:
        return self.summary


class PrototypeServer(Server):
    """Flower's Server loop, plus the strategy's final report once all rounds are done."""

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        history, elapsed = super().fit(num_rounds, timeout)
        self.strategy.recorder.extra["total_seconds"] = elapsed
        summary = RunSummary()
        summary.__dict__.update(history.__dict__)
        summary.summary = self.strategy.finish()
        return summary, elapsed


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
    for key, value in res.metrics.items():
        if key.startswith("correct") and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= res.num_examples
        ):
            return False
        if key in ("pm-l", "pm-v") and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            return False
    return math.isfinite(res.loss)


def _progress(record: Mapping[str, Any]) -> str:
    parts = []
    if record.get("global_accuracy") is not None:
        parts.append(f"GM {record['global_accuracy']:.4f}")
    if record.get("personalized_accuracy") is not None:
        parts.append(f"PM {record['personalized_accuracy']:.4f} (std {record['personalized_std']:.4f})")
    if record.get("pm_l") is not None:
        parts.append(f"PM(L) {record['pm_l']:.4f} PM(V) {record['pm_v']:.4f}")
    if record.get("train_loss") is not None:
        parts.append(f"train loss {record['train_loss']:.4f}")
    up, down = (record.get("bytes_up") or 0) / 1e6, (record.get("bytes_down") or 0) / 1e6
    parts.append(f"up {up:.2f} MB, down {down:.2f} MB")
    parts.append(f"{record.get('seconds') or 0:.1f} s")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------------------


def get_weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


def set_weights(model: torch.nn.Module, weights: Sequence[np.ndarray]) -> None:
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"got {len(weights)} arrays for a model with {len(state)} tensors")
    model.load_state_dict(
        {k: torch.as_tensor(np.asarray(w), dtype=v.dtype) for (k, v), w in zip(state.items(), weights)},
        strict=True,
    )


# predict(features, logits) -> predicted labels
Predictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PrototypeClient(NumPyClient):
    """NumPyClient holding one partition's data; methods override ``fit`` and ``evaluate``."""

    def __init__(
        self,
        config: ExperimentConfig,
        data: ClientData,
        model: SplitModel,
        num_partitions: int,
        state: Any,
    ) -> None:
        self.config = config
        self.data = data
        self.device = data.train_x.device
        self.model = model.to(self.device)
        self.num_partitions = num_partitions
        self.state = state  # context.state: persists across rounds on this node, never sent
        self.max_payload_bytes = int(config.max_payload_mb * 2**20)

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return {
            "partition-id": self.data.partition_id,
            "num-partitions": self.num_partitions,
            "num-train": self.data.num_train,
            "num-test": self.data.num_test,
        }

    def get_parameters(self, config: dict[str, Scalar]) -> list[np.ndarray]:
        return get_weights(self.model)

    # --- helpers ------------------------------------------------------------------------

    def received(self, config: Mapping[str, Scalar], key: str, spec: ArraySpec) -> np.ndarray | None:
        """A broadcast array from the server config, validated; None when not sent."""
        if key not in config:
            return None
        return decode_array(config[key], spec, self.max_payload_bytes)

    def received_class_vectors(self, config: Mapping[str, Scalar], key: str) -> np.ndarray | None:
        """A C x d array from the server config (prototypes, anchors); a clear error when d is not
        this client's feature size (an architecture that does not fit the federation)."""
        vectors = self.received(config, key, ArraySpec((self.data.num_classes, None)))
        if vectors is not None and vectors.shape[1] != self.model.feature_dim:
            raise ValueError(
                f"the server's {key} are {vectors.shape[1]}-d, but this client's model gives "
                f"{self.model.feature_dim}-d features: every client's architecture must end in the same feature size"
            )
        return vectors

    def global_prototypes(self, config: Mapping[str, Scalar]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The server's (C x d prototypes, C mask of classes that have one) on this client's
        device; None before the server has any."""
        prototypes = self.received_class_vectors(config, "global-prototypes")
        mask = self.received(config, "global-prototype-mask", ArraySpec((self.data.num_classes,), ("bool",)))
        if prototypes is None or mask is None:
            return None
        return torch.from_numpy(prototypes).to(self.device), torch.from_numpy(mask).to(self.device)

    def train_kwargs(self, config: Mapping[str, Scalar]) -> dict[str, Any]:
        return {
            "epochs": self.config.local_epochs,
            "batch_size": self.config.batch_size,
            "lr": self.config.round_lr(int(config.get("server-round", 1))),
            "momentum": self.config.momentum,
            "weight_decay": self.config.weight_decay,
            "max_grad_norm": self.config.max_grad_norm,
            "seed": int(config.get("seed", self.config.seed)),
        }

    def fit_metrics(self, train_loss: float, **payload: np.ndarray) -> dict[str, Scalar]:
        metrics: dict[str, Scalar] = {"partition-id": self.data.partition_id, "train-loss": float(train_loss)}
        metrics.update({k: encode_array(v) for k, v in payload.items()})
        return metrics

    def prototype_collector(self, prototype_pass: str, dim: int | None = None) -> FeatureSums | None:
        """What collects the training-mode vectors (``dim``: the feature size unless given) for a
        ``prototype_pass`` of ``during-train`` (every epoch) or ``last-epoch``; None for ``post-eval``."""
        if prototype_pass not in PROTOTYPE_PASSES:
            raise ValueError(f"prototype-pass must be one of {PROTOTYPE_PASSES}, got {prototype_pass!r}")
        if prototype_pass == "post-eval":
            return None
        skip = 0
        if prototype_pass == "last-epoch":
            skip = (self.config.local_epochs - 1) * steps_per_epoch(self.data.num_train, self.config.batch_size)
        return FeatureSums(self.data.num_classes, dim or self.model.feature_dim, self.device, skip)

    def local_prototypes(self, seen: FeatureSums | None = None, space: str = "feature") -> np.ndarray:
        """Per-class means over the training split of the features (C x d) or, ``space="logit"``, the
        logits (C x C): of the training-mode vectors ``seen`` during local training, else of an eval
        pass after it. The eval pass also fills a class whose samples all fell in a skipped one-sample batch."""

        def evaluated() -> np.ndarray:
            features, logits = features_and_logits(self.model, self.data.train_x)
            return class_means(logits if space == "logit" else features, self.data.train_y, self.data.num_classes)[0]

        if seen is None:
            return evaluated()
        prototypes = seen.means()
        missing = (self.data.class_counts() > 0) & (seen.counts.cpu().numpy() == 0)
        if missing.any():
            prototypes[missing] = evaluated()[missing]
        return prototypes

    def restore_personal_model(self) -> bool:
        """Load this client's persistent model from ``context.state``; False on the first round."""
        if "model" not in self.state:
            return False
        stored = self.state["model"].to_torch_state_dict()
        self.model.load_state_dict({k: stored[k] for k in self.model.state_dict()})
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():  # also those not in state_dict (a frozen head)
                buffer.copy_(stored[name])
        return True

    def store_personal_model(self) -> None:
        """Keep the whole model (parameters and every buffer) in ``context.state``."""
        from flwr.app import ArrayRecord

        tensors = dict(self.model.named_buffers()) | self.model.state_dict()
        self.state["model"] = ArrayRecord({k: v.detach().cpu() for k, v in tensors.items()})

    def global_test_scores(self, predict: Predictor = head_prediction) -> dict[str, Scalar]:
        """FedNH's PM(L) and PM(V) of the current model on the (balanced) global test set.

        ``predict(features, logits) -> labels`` is the method's predictor. PM(L) weights each class
        by this client's share of it in training, PM(V) weights the classes it holds equally.
        Empty when ``global-test-pm`` is off.
        """
        if not self.config.global_test_pm:
            return {}
        x, y = load_global_test(
            self.config.dataset, self.config.data_dir, str(self.device), self.config.global_test_pm_per_class
        )
        predicted = predict(*features_and_logits(self.model, x))
        correct = torch.bincount(y[predicted == y], minlength=self.data.num_classes).cpu().numpy()
        tested = torch.bincount(y, minlength=self.data.num_classes).cpu().numpy()
        counts = self.data.class_counts()
        return {
            "pm-l": class_weighted_accuracy(correct, tested, counts),
            "pm-v": class_weighted_accuracy(correct, tested, counts > 0),
        }

    def evaluate_predictors(
        self, predictors: Mapping[str, Predictor], reported: str
    ) -> tuple[float, int, dict[str, Scalar]]:
        """Each predictor on the local test split (``correct-<name>``), the ``reported`` one also as
        ``correct`` and for PM(L)/PM(V); the loss is the head's: (loss, num_test, metrics)."""
        features, logits = features_and_logits(self.model, self.data.test_x)
        loss, _ = head_loss_and_correct(logits, self.data.test_y)
        metrics: dict[str, Scalar] = {
            f"correct-{name}": int((predict(features, logits) == self.data.test_y).sum())
            for name, predict in predictors.items()
        }
        metrics |= {"correct": metrics[f"correct-{reported}"], "partition-id": self.data.partition_id}
        metrics |= self.global_test_scores(predictors[reported])
        return loss, self.data.num_test, metrics

    def evaluate_head(self) -> tuple[float, int, dict[str, Scalar]]:
        """The classifier head on the local test split (``correct``) and on the global test set
        (PM(L)/PM(V)): (loss, num_test, metrics)."""
        _, logits = features_and_logits(self.model, self.data.test_x)
        loss, correct = head_loss_and_correct(logits, self.data.test_y)
        metrics = {"correct": correct, "partition-id": self.data.partition_id, **self.global_test_scores()}
        return loss, self.data.num_test, metrics
