"""The wire: what server and clients send each other, and the checks on it, whichever Flower front
carries it.

Every array travels as ``np.save(..., allow_pickle=False)`` bytes: on the legacy front, model
arrays as the ``Parameters`` and every other array in ``FitRes.metrics`` (client -> server) and in
``FitIns.config`` / ``EvaluateIns.config`` (server -> client), next to scalar values; on the
Message API, the same bytes in ``ArrayRecord`` records (:mod:`protofl.federation.message_records`).
Each front reads a client's reply once, at its edge, into a :class:`Reply`, which is all the server
template reads. Every key two modules share is spelled here, once; a key only one method uses is
spelled in that method's module. Nothing is ever unpickled: a blob is read only after its ``.npy``
header is checked.

Typed payloads:

- :class:`ClassStatistics`: a client's per-class means and counts (the upload of every method
  that sends prototypes, class means or knowledge), checked on every decode;
- :class:`ClassVectors`: one vector per class and the mask of classes that have one (global
  prototypes, knowledge), as the server broadcasts them.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from protofl.federation.screen import UploadScale
from protofl.typed_fields import Scalar, is_int, is_number
from protofl.task.privacy import privatize_class_means
from protofl.task.storage import NUMPY_HEADER_LOCK

ALLOWED_DTYPES = frozenset({"float32", "float64", "int32", "int64", "bool"})
NPY_MAGIC = b"\x93NUMPY"

# per-round config (server -> client)
SERVER_ROUND = "server-round"
SEED = "seed"
RUN_KEY, RUN_TOKEN = "run-key", "run-token"  # which run's client state: its directory's name, its fresh start
CHECKPOINTED_ROUND = "checkpointed-round"  # the round of the server's last checkpoint
CLIENT_STATE_DIR = "client-state-dir"  # where a node without a state-dir keeps its state (simulation only)
MARKED_STATE_DIR = "marked-state-dir"  # the state dir holding the ServerApp's run marker (simulation only)
CODE_DIGEST = "code-digest"  # the ServerApp's protofl (code_identity.source_digest; simulation only)
GLOBAL_PROTOTYPES = "global-prototypes"  # ClassVectors: FedProto, FedCoSR, FedSA
EVALUATE_ROUND = "evaluate-round"  # in a fit config: score the model of this round before training
# properties and metrics (client -> server)
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
NUM_TRAIN = "num-train"
NUM_TEST = "num-test"
STATE_ROUND = "state-round"  # the round of the newest state a node holds for its partition (0: none)
TRAIN_LOSS = "train-loss"
CONTRASTIVE_LOSS = "contrastive-loss"  # a method's contrastive term, its batch mean (FedCoSR, MOON, FedRCL)
PROXIMAL_LOSS = "proximal-loss"  # ||w - anchor||^2 / 2, its batch mean (FedProx, Ditto, FedAMP)
SHARED_LOSS = "shared-model-loss"  # the shared second model's loss, its batch mean (FML; FedKD: the mentee's)
COMPUTE = "compute"  # fit: how the client computes (encode_compute), kept in results.json's client_compute
CLASS_MEANS = "class-means"
CLASS_COUNTS = "class-counts"
CORRECT = "correct"  # evaluation: correct predictions of the reported predictor; "correct-<name>": of each
PM_L, PM_V = "pm-l", "pm-v"  # evaluation on the global test set (FedNH's protocol)
# a fit result's evaluation (``EVALUATE_ROUND``): each evaluation metric with this prefix, and
# "evaluated-loss", "evaluated-num-examples" for an evaluate reply's loss and size
EVALUATED = "evaluated-"


class PayloadError(ValueError):
    """A payload that must not be used (unreadable, wrong shape or dtype, non-finite, too big)."""


def checked_count(value: Any, name: str, minimum: int = 0) -> int:
    """A count a client reports: an integer (not a bool) >= ``minimum``; raises :class:`PayloadError`."""
    if not is_int(value) or value < minimum:
        raise PayloadError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def checked_loss(value: Any, name: str) -> float:
    """A loss a client reports: a finite number (not a bool) >= 0; raises :class:`PayloadError`."""
    if not is_number(value) or not 0.0 <= value < math.inf:
        raise PayloadError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def rejection_reason(err: BaseException | str, limit: int = 300) -> str:
    """Why a reply was rejected, for logs and results.json: a client controls the values quoted in
    it, so it is cut to ``limit`` characters."""
    if isinstance(err, BaseException):
        err = str(err) if isinstance(err, PayloadError) else f"{type(err).__name__}: {err}"
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."


# how Flower's legacy strategies see a ClientApp's error reply, and how Ray wraps the exception
_ERROR_REPLY = re.compile(r"Message contains an Error \(reason: (.*)\)\. It originated during client-side execution",
                          re.S)
_CAUSE = "\nThe above exception was the direct cause of the following exception:"


class ClientFailed(Exception):
    """A message that failed on the client (:func:`client_error`'s line)."""


@dataclass
class Blobs:
    """The shared entries of a reply as ``.npy`` blobs, in the server's order."""

    tensors: list[Any] = field(default_factory=list)


@dataclass
class Reply:
    """A client's reply as the server template reads it, whichever front it came by, unchecked: a
    fit or evaluate result's fields, or a query's ``properties``; ``problem``: why the front could
    not read it (admission drops it with that reason)."""

    parameters: Blobs = field(default_factory=Blobs)
    num_examples: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    loss: Any = None
    problem: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)


def describe_failure(failure: Any) -> str:
    """A failed message (an exception, or a reply with an error status) in one line: for an error
    reply, the client's own exception line, without the tracebacks a Ray simulation wraps it in."""
    if not isinstance(failure, BaseException):
        _, res = failure
        return f"status {res.status.code}: {res.status.message}"
    text = str(failure)
    if isinstance(failure, ClientFailed):
        return text
    if match := _ERROR_REPLY.search(text):
        return client_error(match.group(1))
    return f"{type(failure).__name__}: {text}"


def client_error(reason: str) -> str:
    """An error reply's reason in one line: the client's own exception line, without the
    tracebacks a Ray simulation wraps it in."""
    text = reason.split(_CAUSE)[0]  # Ray: the client's traceback, then the actor's
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"client error: {lines[-1] if lines else text}"[:1000]


@dataclass(frozen=True)
class ArraySpec:
    """What an array payload must look like. ``None`` in ``shape`` matches any length."""

    shape: tuple[int | None, ...]
    dtypes: tuple[str, ...] = ("float32",)
    nonnegative: bool = False
    scale: UploadScale = "round"  # a named upload: how the magnitude screen treats it (its UploadScale)

    @classmethod
    def like(cls, array: np.ndarray, **fields: Any) -> "ArraySpec":
        """An array of ``array``'s shape and dtype (and the other ``fields``)."""
        return cls(tuple(array.shape), (array.dtype.name,), **fields)


def encode_array(array: np.ndarray) -> bytes:
    """numpy array -> ``.npy`` bytes (never pickled)."""
    array = np.ascontiguousarray(array).reshape(np.shape(array))  # (ascontiguousarray makes a 0-d array 1-d)
    if array.dtype.name not in ALLOWED_DTYPES:
        raise PayloadError(f"dtype {array.dtype} is not allowed on the wire")
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def read_npy_header(stream: io.BytesIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the ``.npy`` blob ``stream`` starts; it is left at the data.
    numpy's header parse, one thread at a time (protofl/task/storage.py)."""
    major, _ = np.lib.format.read_magic(stream)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    with NUMPY_HEADER_LOCK:
        return read_header(stream)


def decode_array(blob: Any, spec: ArraySpec | tuple[ArraySpec, ...], max_bytes: int) -> np.ndarray:
    """``.npy`` bytes -> array, checked against ``spec`` (alternatives: the one with as many axes as
    the blob's header claims, else the first); raises :class:`PayloadError`."""
    if not isinstance(blob, bytes):
        raise PayloadError(f"expected bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise PayloadError(f"{len(blob)} bytes exceeds the cap of {max_bytes}")
    if not blob.startswith(NPY_MAGIC):
        raise PayloadError("not a .npy array")
    # Check the header before loading: a header may claim any shape, and loading allocates it.
    stream = io.BytesIO(blob)
    try:
        shape, fortran_order, dtype = read_npy_header(stream)
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise PayloadError(f"unreadable array header ({err})") from None
    specs = spec if isinstance(spec, tuple) else (spec,)
    spec = next((s for s in specs if len(s.shape) == len(shape)), specs[0])
    if dtype.name not in spec.dtypes:
        raise PayloadError(f"dtype {dtype} not in {spec.dtypes}")
    if len(shape) != len(spec.shape) or any(want is not None and want != got for want, got in zip(spec.shape, shape)):
        raise PayloadError(f"shape {shape} does not match {spec.shape}")
    if len(blob) - stream.tell() != math.prod(shape) * dtype.itemsize:
        raise PayloadError(f"data size does not match the header's shape {shape}")
    # the data as the checked header describes it (np.load would parse the header a second time)
    array = np.frombuffer(blob, dtype, math.prod(shape), stream.tell())
    array = array.reshape(shape, order="F" if fortran_order else "C").copy(order="K")
    if not array.dtype.isnative:  # e.g. big-endian float32 from another host: same values, native order
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise PayloadError("non-finite values")
    if spec.nonnegative and (array < 0).any():
        raise PayloadError("negative values")
    return array


def decode_entry(values: Mapping[str, Any], key: str, spec: ArraySpec, max_bytes: int) -> np.ndarray:
    """The array under ``key`` of a metrics/config dict; its errors name the key."""
    if key not in values:
        raise PayloadError(f"missing {key!r}")
    try:
        return decode_array(values[key], spec, max_bytes)
    except PayloadError as err:
        raise PayloadError(f"{key!r}: {err}") from None


def indexed_keys(name: str, count: int) -> list[str]:
    """The keys of ``count`` arrays that travel under one name (one per shared model entry, say):
    ``name/0``, ``name/1``, ..."""
    return [f"{name}/{i}" for i in range(count)]


def indexed(name: str, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` under :func:`indexed_keys` of ``name``, for a broadcast or an upload."""
    return dict(zip(indexed_keys(name, len(arrays)), arrays))


def indexed_entries(
    values: Mapping[str, Any], name: str, specs: Sequence[ArraySpec], max_bytes: int
) -> list[np.ndarray]:
    """The arrays :func:`indexed` sent under ``name``, each checked against its spec."""
    return [decode_entry(values, key, spec, max_bytes) for key, spec in zip(indexed_keys(name, len(specs)), specs)]


def payload_bytes(values: Mapping[str, Any]) -> int:
    """Bytes carried by the ``bytes`` values of a config/metrics dict."""
    return sum(len(v) for v in values.values() if isinstance(v, bytes))


# ---------------------------------------------------------------------------------------
# Per-round config
# ---------------------------------------------------------------------------------------


def round_config(
    server_round: int, seed: int, run_key: str = "", run_token: str = "", checkpointed: int = 0,
    client_state_dir: str = "", marked_state_dir: str = "", code_digest: str = "",
) -> dict[str, Scalar]:
    """The scalars every instruction carries: the round, the client's seed for it, which run's
    state the client keeps, the round of the server's last checkpoint (client state from before
    it is no longer needed) and, in simulation, the default state dir, the state dir in which
    the ServerApp placed the run's marker (a client keeping its state there must see it) and the
    digest of the ServerApp's code (a client running other code refuses)."""
    dirs = {CLIENT_STATE_DIR: client_state_dir, MARKED_STATE_DIR: marked_state_dir, CODE_DIGEST: code_digest}
    return {SERVER_ROUND: server_round, SEED: seed, RUN_KEY: run_key, RUN_TOKEN: run_token,
            CHECKPOINTED_ROUND: checkpointed} | {k: v for k, v in dirs.items() if v}


def server_round(config: Mapping[str, Scalar]) -> int:
    return int(config.get(SERVER_ROUND, 1))


def round_seed(config: Mapping[str, Scalar], default: int) -> int:
    return int(config.get(SEED, default))


def run_identity(config: Mapping[str, Scalar]) -> tuple[str, str]:
    """(run key, run token) of the run an instruction belongs to."""
    return str(config.get(RUN_KEY, "")), str(config.get(RUN_TOKEN, ""))


def client_state_dir(config: Mapping[str, Scalar]) -> str:
    """The state dir the server names for nodes that set none (simulation); empty: none named."""
    return str(config.get(CLIENT_STATE_DIR, ""))


def code_digest(config: Mapping[str, Scalar]) -> str:
    """The digest of the ServerApp's code (simulation); empty: none sent."""
    return str(config.get(CODE_DIGEST, ""))


def marked_state_dir(config: Mapping[str, Scalar]) -> str:
    """The state dir holding the ServerApp's marker of the run (simulation); empty: none."""
    return str(config.get(MARKED_STATE_DIR, ""))


def checkpointed_round(config: Mapping[str, Scalar]) -> int:
    """The server's last checkpointed round (without checkpoints: the round before this one)."""
    return int(config.get(CHECKPOINTED_ROUND, server_round(config) - 1))


def evaluation_as_fit_metrics(loss: float, num_examples: int, metrics: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """An evaluate reply's parts as the ``EVALUATED`` metrics of a fit reply (``EVALUATE_ROUND``)."""
    return {EVALUATED + k: v for k, v in metrics.items()} | {
        f"{EVALUATED}loss": float(loss), f"{EVALUATED}num-examples": num_examples,
    }


def embedded_evaluation(res: Reply) -> Reply:
    """The evaluation a fit reply carries (:func:`evaluation_as_fit_metrics`) as an evaluate reply,
    unchecked: the server checks it like any other."""
    metrics = {k[len(EVALUATED):]: v for k, v in dict(res.metrics).items()
               if isinstance(k, str) and k.startswith(EVALUATED)}
    loss, num_examples = metrics.pop("loss", None), metrics.pop("num-examples", None)
    return Reply(num_examples=num_examples, metrics=metrics, loss=loss)


# ---------------------------------------------------------------------------------------
# Typed payloads
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassStatistics:
    """One client's per-class mean vectors (C x d float32, zero rows for absent classes) and
    class counts (C int64) over its training split."""

    means: np.ndarray
    counts: np.ndarray

    def to_metrics(self) -> dict[str, bytes]:
        return {CLASS_MEANS: encode_array(self.means), CLASS_COUNTS: encode_array(self.counts)}

    @classmethod
    def from_metrics(
        cls, metrics: Mapping[str, Any], num_classes: int, dim: int, num_examples: int, max_bytes: int,
        expected_counts: np.ndarray | None = None,
    ) -> "ClassStatistics":
        """Decoded and checked, always: shapes and dtypes, finite means, counts >= 0, each at
        most ``num_examples`` and together exactly ``num_examples`` (summed without overflow),
        and equal to ``expected_counts`` where the server knows them."""
        means = decode_entry(metrics, CLASS_MEANS, ArraySpec((num_classes, dim)), max_bytes)
        counts = decode_entry(metrics, CLASS_COUNTS, ArraySpec((num_classes,), ("int64",), True), max_bytes)
        if (counts > num_examples).any():
            raise PayloadError(f"a class count exceeds num_examples ({num_examples})")
        if sum(counts.tolist()) != num_examples:  # Python ints: no int64 wrap-around
            raise PayloadError("class counts do not add up to num_examples")
        if expected_counts is not None and not np.array_equal(counts, expected_counts):
            raise PayloadError("class counts differ from the partition's own")
        return cls(means, counts)

    def privatized(self, clip: float, noise: float) -> "ClassStatistics":
        """Differentially private means (``dp-clip``, ``dp-noise``): clipped, with Gaussian noise
        from the OS's entropy, never from the run seed, which the server knows."""
        means = privatize_class_means(self.means, self.counts, clip, noise, np.random.default_rng())
        return ClassStatistics(means, self.counts)


@dataclass(frozen=True)
class ClassVectors:
    """One vector per class (C x d) and the C mask of the classes that have one."""

    vectors: np.ndarray
    mask: np.ndarray

    def to_config(self, name: str) -> dict[str, np.ndarray]:
        """The broadcast arrays, under ``name`` and ``name-mask``."""
        return {name: self.vectors, f"{name}-mask": self.mask}

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], name: str, num_classes: int, dim: int, max_bytes: int
    ) -> "ClassVectors | None":
        """Read back what :meth:`to_config` wrote; None when not sent."""
        vectors = decode_class_vectors(config, name, num_classes, dim, max_bytes)
        if vectors is None:
            return None
        return cls(vectors, decode_entry(config, f"{name}-mask", ArraySpec((num_classes,), ("bool",)), max_bytes))


def decode_class_vectors(
    config: Mapping[str, Any], name: str, num_classes: int, dim: int, max_bytes: int
) -> np.ndarray | None:
    """A C x ``dim`` float32 array of the server's config; None when not sent. Another vector size is
    a clear error: this client's architecture does not fit the federation's."""
    if name not in config:
        return None
    vectors = decode_entry(config, name, ArraySpec((num_classes, None)), max_bytes)
    if vectors.shape[1] != dim:
        raise PayloadError(
            f"the server's {name} are {vectors.shape[1]}-d, but this client's model gives "
            f"{dim}-d features: every client's architecture must end in the same feature size"
        )
    return vectors


# what a client's compute description may hold (compute_description's fields), each short
COMPUTE_FIELDS = ("host", "nice", "device", "device_name", "threads", "cpu_capability", "autocast", "native_bf16",
                  "memory_format", "training_step", "clients_in_flight", "batchnorm_stats")
MAX_COMPUTE_CHARS, MAX_COMPUTE_FIELD_CHARS = 1024, 80


def encode_compute(described: Mapping[str, Any]) -> str:
    """A client's compute description (:func:`protofl.task.train.compute_description`) as a fit metric."""
    return json.dumps({k: described[k] for k in COMPUTE_FIELDS if k in described}, sort_keys=True)


def decode_compute(value: Any) -> dict[str, Any] | None:
    """The known short fields of a client's compute description: a string field of at most
    80 characters, a bool, an int in [0, 10^6); None for anything that is not a JSON object of
    at most 1,024 characters. Never raises."""
    if not isinstance(value, str) or len(value) > MAX_COMPUTE_CHARS:
        return None
    try:
        described = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(described, dict):
        return None

    def short(v: Any) -> bool:
        return (isinstance(v, str) and len(v) <= MAX_COMPUTE_FIELD_CHARS or isinstance(v, bool)
                or type(v) is int and 0 <= v < 10**6)

    return {k: v for k, v in described.items() if k in COMPUTE_FIELDS and short(v)}
