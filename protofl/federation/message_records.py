"""The records of the Message-API front: how protofl's instructions and replies travel as Flower
``Message`` content, and how each side reads the other's.

An instruction (server -> client) holds three records:

- ``arrays``: the shared model entries (an ``ArrayRecord`` keyed by their names in the model);
- ``broadcasts``: the method's named arrays for this client (global prototypes, anchors, ...);
- ``config``: the round's scalars (a ``ConfigRecord``; :func:`protofl.federation.wire.round_config`).

A fit reply holds ``arrays`` (the shared entries), ``uploads`` (the class statistics and the
method's named uploads, when there are any), ``metrics`` (a ``MetricRecord`` of the numbers, with
``num-examples``) and ``config`` (the strings and flags); an evaluate reply ``metrics`` (with
``loss`` and ``num-examples``) and ``config``; a query reply ``properties``. So a fit reply of
FedAvg is what Flower's own strategies read: one ``ArrayRecord``, one ``MetricRecord`` weighted by
``num-examples``.

Every array is the same ``.npy`` blob the legacy front sends (``np.save``, never pickled), and the
server checks it as it checks the legacy one (:func:`protofl.federation.wire.decode_array`), so
both fronts give the same numbers. :func:`read_reply` never raises: what it cannot read is the
reply's ``problem``, and admission drops it with that reason.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from protofl.federation.wire import Blobs, Reply, encode_array, read_npy_header
from protofl.task.storage import NUMPY_HEADER_LOCK
from protofl.typed_fields import Scalar

PARAMETERS, BROADCASTS, CONFIG = "arrays", "broadcasts", "config"  # an instruction's records
UPLOADS, METRICS, PROPERTIES = "uploads", "metrics", "properties"  # a reply's, besides arrays and config
NUM_EXAMPLES, LOSS = "num-examples", "loss"  # a reply's size, an evaluate reply's loss (in metrics)
NUMPY = "numpy.ndarray"  # Flower's serialization type of a .npy blob


def blob_array(blob: bytes) -> Array:
    """One of protofl's own ``.npy`` blobs (:func:`~protofl.federation.wire.encode_array`) as a
    Flower ``Array``: the same bytes, its dtype and shape read from the blob's header."""
    shape, _, dtype = read_npy_header(io.BytesIO(blob))
    return Array(dtype=str(dtype), shape=tuple(shape), stype=NUMPY, data=blob)


def ndarray_array(array: np.ndarray) -> Array:
    """A numpy array as a Flower ``Array`` of protofl's ``.npy`` blob (a dtype the wire allows)."""
    return Array(dtype=str(array.dtype), shape=tuple(array.shape), stype=NUMPY, data=encode_array(array))


def split_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """A legacy config or metrics dict as (numbers, strings and flags, ``.npy`` blobs): what goes
    in a ``MetricRecord``, a ``ConfigRecord`` and an ``ArrayRecord``."""
    numbers, others, blobs = {}, {}, {}
    for key, value in values.items():
        if isinstance(value, bytes):
            blobs[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = value
        else:
            others[key] = value
    return numbers, others, blobs


def instruction(parameters: ArrayRecord, config: Mapping[str, Any]) -> RecordDict:
    """An instruction's content: the shared entries, and a legacy config's scalars and arrays."""
    numbers, others, blobs = split_values(config)
    return RecordDict({PARAMETERS: parameters, BROADCASTS: ArrayRecord({k: blob_array(v) for k, v in blobs.items()}),
                       CONFIG: ConfigRecord(numbers | others)})


def read_instruction(content: RecordDict) -> tuple[list[np.ndarray], dict[str, Any]]:
    """(the shared entries in order, the config with each broadcast as its ``.npy`` bytes): what
    the client template's ``fit`` and ``evaluate`` take, as the legacy front hands them over."""
    with NUMPY_HEADER_LOCK:  # numpy's header parse, one thread at a time (protofl/task/storage.py)
        parameters = [array.numpy() for array in content.array_records[PARAMETERS].values()]
    broadcasts = {name: array.data for name, array in content.array_records[BROADCASTS].items()}
    return parameters, dict(content.config_records[CONFIG]) | broadcasts


def fit_reply(names: Sequence[str], parameters: Sequence[np.ndarray], num_examples: int,
              metrics: Mapping[str, Scalar]) -> RecordDict:
    """A fit reply's content: the shared entries under their ``names``, the metrics' arrays as
    uploads, numbers and the rest as metrics and config."""
    numbers, others, blobs = split_values(metrics)
    records: dict[str, Any] = {PARAMETERS: ArrayRecord({n: ndarray_array(a) for n, a in zip(names, parameters)}),
                               METRICS: MetricRecord(numbers | {NUM_EXAMPLES: num_examples})}
    if blobs:
        records[UPLOADS] = ArrayRecord({k: blob_array(v) for k, v in blobs.items()})
    if others:
        records[CONFIG] = ConfigRecord(others)
    return RecordDict(records)


def evaluate_reply(loss: float, num_examples: int, metrics: Mapping[str, Scalar]) -> RecordDict:
    numbers, others, _ = split_values(metrics)
    records: dict[str, Any] = {METRICS: MetricRecord(numbers | {LOSS: float(loss), NUM_EXAMPLES: num_examples})}
    if others:
        records[CONFIG] = ConfigRecord(others)
    return RecordDict(records)


def properties_reply(properties: Mapping[str, Scalar]) -> RecordDict:
    return RecordDict({PROPERTIES: ConfigRecord(dict(properties))})


def read_reply(message: Message, names: Sequence[str]) -> Reply:
    """A reply message's records as a :class:`Reply` (``names``: the shared entries, in the
    server's order). Every record is optional; a key sent twice, an entry missing or not asked
    for, or an array of another serialization makes the reply's ``problem``. Never raises."""
    try:
        content = message.content
        values: dict[str, Any] = {}
        for kind in (METRICS, CONFIG, PROPERTIES):
            for records in (content.metric_records, content.config_records):
                if kind in records:
                    values = _merged(values, dict(records[kind]), kind)
        uploads = content.array_records.get(UPLOADS, ArrayRecord())
        values = _merged(values, {name: _blob(array, name) for name, array in uploads.items()}, UPLOADS)
        reply = Reply(num_examples=values.pop(NUM_EXAMPLES, None), loss=values.pop(LOSS, None))
        if PROPERTIES in content.config_records:
            reply.properties = values
            return reply
        reply.metrics = values
        if PARAMETERS in content.array_records:
            sent = content.array_records[PARAMETERS]
            if set(sent) != set(names):
                raise ValueError(f"the {PARAMETERS} record holds {sorted(set(sent) - set(names))[:5]} and lacks "
                                 f"{sorted(set(names) - set(sent))[:5]}")
            reply.parameters = Blobs([_blob(sent[name], name) for name in names])
        return reply
    except Exception as err:  # whatever the message holds, the round goes on without it
        return Reply(problem=f"an unreadable reply ({type(err).__name__}: {err})"[:300])


def _merged(values: dict[str, Any], more: dict[str, Any], record: str) -> dict[str, Any]:
    if twice := values.keys() & more.keys():
        raise ValueError(f"{sorted(twice)[:3]} sent twice (in {record})")
    return values | more


def _blob(array: Any, name: str) -> bytes:
    if not isinstance(array, Array) or array.stype != NUMPY or not isinstance(array.data, bytes):
        raise ValueError(f"{name!r} is not a numpy array")
    return array.data
