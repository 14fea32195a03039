import ast
import io
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from inprocess import run_in_process

from protofl.federation.wire import (
    CLASS_COUNTS,
    ArraySpec,
    ClassStatistics,
    ClassVectors,
    PayloadError,
    decode_array,
    encode_array,
)
from protofl.task.storage import arrays_from_bytes, arrays_to_bytes

SPEC = ArraySpec((3, 4), ("float32",))
CAP = 1 << 20


def test_round_trip_keeps_values_dtype_and_shape():
    array = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    decoded = decode_array(encode_array(array), SPEC, CAP)
    assert decoded.dtype == np.float32 and decoded.shape == (3, 4)
    np.testing.assert_array_equal(decoded, array)


def test_a_scalar_array_keeps_its_shape():  # a learnable scale (FedNH's) is a 0-d model entry
    decoded = decode_array(encode_array(np.array(30.0, np.float32)), ArraySpec(()), CAP)
    assert decoded.shape == () and decoded == 30.0


def test_round_trip_counts_and_masks():
    counts = np.array([0, 5, 2], dtype=np.int64)
    mask = np.array([False, True, True])
    np.testing.assert_array_equal(decode_array(encode_array(counts), ArraySpec((3,), ("int64",)), CAP), counts)
    np.testing.assert_array_equal(decode_array(encode_array(mask), ArraySpec((3,), ("bool",)), CAP), mask)


def test_wildcard_dimension():
    array = np.zeros((5, 4), np.float32)
    assert decode_array(encode_array(array), ArraySpec((None, 4)), CAP).shape == (5, 4)


def test_rejects_garbage_bytes():
    with pytest.raises(PayloadError, match="not a .npy"):
        decode_array(b"\x00\x01garbage", SPEC, CAP)


def test_rejects_truncated_npy():
    blob = encode_array(np.zeros((3, 4), np.float32))
    with pytest.raises(PayloadError, match="data size"):
        decode_array(blob[:-8], SPEC, CAP)
    with pytest.raises(PayloadError, match="unreadable"):
        decode_array(blob[:20], SPEC, CAP)


def test_rejects_header_claiming_a_huge_array_without_allocating_it():
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": (10**13,)})
    blob = buffer.getvalue() + b"\x00" * 16  # a header for 40 TB, followed by 16 bytes
    with pytest.raises(PayloadError, match="data size"):
        decode_array(blob, ArraySpec((None,)), CAP)


class _Bomb:
    triggered = False

    def __reduce__(self):
        return (_Bomb._explode, ())

    @staticmethod
    def _explode():
        _Bomb.triggered = True
        return "boom"


def test_rejects_plain_pickle_without_unpickling():
    with pytest.raises(PayloadError):
        decode_array(pickle.dumps(_Bomb()), SPEC, CAP)
    assert not _Bomb.triggered


def test_rejects_npy_with_pickled_objects_without_unpickling():
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Bomb()], dtype=object), allow_pickle=True)
    _Bomb.triggered = False
    with pytest.raises(PayloadError, match="dtype object"):
        decode_array(buffer.getvalue(), SPEC, CAP)
    assert not _Bomb.triggered


def test_rejects_wrong_shape():
    with pytest.raises(PayloadError, match="shape"):
        decode_array(encode_array(np.zeros((4, 3), np.float32)), SPEC, CAP)
    with pytest.raises(PayloadError, match="shape"):
        decode_array(encode_array(np.zeros((3, 4, 1), np.float32)), SPEC, CAP)


def test_rejects_wrong_dtype():
    with pytest.raises(PayloadError, match="dtype"):
        decode_array(encode_array(np.zeros((3, 4), np.float64)), SPEC, CAP)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_rejects_non_finite(bad):
    array = np.zeros((3, 4), np.float32)
    array[1, 2] = bad
    with pytest.raises(PayloadError, match="non-finite"):
        decode_array(encode_array(array), SPEC, CAP)


def test_rejects_oversize():
    blob = encode_array(np.zeros((3, 4), np.float32))
    with pytest.raises(PayloadError, match="exceeds"):
        decode_array(blob, SPEC, len(blob) - 1)
    assert decode_array(blob, SPEC, len(blob)).shape == (3, 4)


def test_rejects_negative_counts_and_non_bytes():
    with pytest.raises(PayloadError, match="negative"):
        decode_array(encode_array(np.array([1, -1, 0])), ArraySpec((3,), ("int64",), nonnegative=True), CAP)
    with pytest.raises(PayloadError, match="expected bytes"):
        decode_array("text", SPEC, CAP)


def test_encode_refuses_object_arrays():
    with pytest.raises(PayloadError):
        encode_array(np.array([{}], dtype=object))


# --- typed payloads -----------------------------------------------------------------------

MEANS = np.arange(6, dtype=np.float32).reshape(3, 2)


def statistics_metrics(counts, means=MEANS):
    return ClassStatistics(means, np.array(counts, dtype=np.int64)).to_metrics()


def test_class_statistics_round_trip():
    decoded = ClassStatistics.from_metrics(statistics_metrics([2, 0, 5]), 3, 2, num_examples=7, max_bytes=CAP)
    np.testing.assert_array_equal(decoded.means, MEANS)
    assert decoded.counts.tolist() == [2, 0, 5] and decoded.counts.dtype == np.int64


@pytest.mark.parametrize(
    "counts,num_examples,message",
    [([2, 0, 5], 8, "do not add up"), ([0, 0, 7], 6, "exceeds num_examples"), ([3, -1, 5], 7, "negative")],
)
def test_class_statistics_checks_always_run(counts, num_examples, message):
    with pytest.raises(PayloadError, match=message):
        ClassStatistics.from_metrics(statistics_metrics(counts), 3, 2, num_examples, CAP)


def test_class_counts_are_summed_without_int64_wrap_around():
    # nine counts of n = 2^61, each <= n: in int64 they sum to 9 * 2^61 - 2^64 = n
    n = 2**61
    counts = np.array([n] * 9 + [0], dtype=np.int64)
    assert int(counts.sum()) == n  # what a check in int64 would accept
    metrics = ClassStatistics(np.zeros((10, 2), np.float32), counts).to_metrics()
    with pytest.raises(PayloadError, match="do not add up"):
        ClassStatistics.from_metrics(metrics, 10, 2, num_examples=n, max_bytes=CAP)


def test_class_statistics_wrong_shape_missing_key_and_non_finite_name_the_key():
    with pytest.raises(PayloadError, match="'class-means': shape"):
        ClassStatistics.from_metrics(statistics_metrics([1, 1, 1]), 3, 4, 3, CAP)
    metrics = statistics_metrics([1, 1, 1])
    del metrics[CLASS_COUNTS]
    with pytest.raises(PayloadError, match="missing 'class-counts'"):
        ClassStatistics.from_metrics(metrics, 3, 2, 3, CAP)
    bad = MEANS.copy()
    bad[0, 0] = np.inf
    with pytest.raises(PayloadError, match="'class-means': non-finite"):
        ClassStatistics.from_metrics(statistics_metrics([1, 1, 1], bad), 3, 2, 3, CAP)


def test_class_vectors_round_trip_and_feature_size_mismatch_is_clear():
    vectors = ClassVectors(MEANS, np.array([True, False, True]))
    config = {k: encode_array(v) for k, v in vectors.to_config("global-prototypes").items()}
    decoded = ClassVectors.from_config(config, "global-prototypes", 3, 2, CAP)
    np.testing.assert_array_equal(decoded.vectors, MEANS)
    assert decoded.mask.tolist() == [True, False, True]
    assert ClassVectors.from_config({}, "global-prototypes", 3, 2, CAP) is None
    with pytest.raises(PayloadError, match="2-d, but this client's model gives 5-d"):
        ClassVectors.from_config(config, "global-prototypes", 3, 5, CAP)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_big_endian_arrays_are_read_in_native_byte_order(dtype):
    array = np.arange(6, dtype=dtype).reshape(2, 3)
    big_endian = encode_array(array.astype(array.dtype.newbyteorder(">")))
    decoded = decode_array(big_endian, ArraySpec((2, 3), (dtype,)), 10**6)
    assert decoded.dtype == np.dtype(dtype) and decoded.dtype.isnative
    np.testing.assert_array_equal(decoded, array)


def test_class_counts_must_be_the_partitions_own_where_the_server_knows_them():
    stats = ClassStatistics(np.zeros((3, 2), np.float32), np.array([2, 1, 0], np.int64))
    metrics = stats.to_metrics()
    ClassStatistics.from_metrics(metrics, 3, 2, 3, 10**6, expected_counts=np.array([2, 1, 0]))
    with pytest.raises(PayloadError, match="differ from the partition's own"):
        ClassStatistics.from_metrics(metrics, 3, 2, 3, 10**6, expected_counts=np.array([1, 2, 0]))


def most_parses_at_once(monkeypatch, seconds):
    """A list whose one entry becomes the most ast.parse calls seen in flight at once, each held
    open ``seconds`` long enough for another thread to enter."""
    inside, most = [0], [0]
    parse = ast.parse

    def slow_parse(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(seconds)
        try:
            return parse(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(ast, "parse", slow_parse)
    return most


def test_arrays_are_decoded_one_header_at_a_time_across_threads(monkeypatch):
    """numpy parses a .npy header with ast.literal_eval, and CPython 3.11 keeps the AST
    constructor's recursion depth per interpreter, set from the calling thread's stack: two threads
    parsing at once (clients on threads, tests/inprocess.py) raised "SystemError: AST constructor
    recursion depth mismatch" in a `.ci/run`. Every decoder parses under one lock: never two at once."""
    most = most_parses_at_once(monkeypatch, 0.002)
    array = np.ones((3, 4), np.float32)
    blob, archive = encode_array(array), arrays_to_bytes({"a": array, "b": array})

    def decode_both():
        for _ in range(5):
            assert (decode_array(blob, SPEC, CAP) == array).all()
            assert arrays_from_bytes(archive).keys() == {"a", "b"}

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(decode_both) for _ in range(4)]:
            future.result()
    assert most == [1]


def test_an_in_process_federations_clients_parse_one_header_at_a_time(monkeypatch):
    """The in-process federation's clients train at once on Flower's thread pool, and Flower decodes
    each one's parameters with np.load (a header parse each): a `.ci/run` lost a client's round to
    "SystemError: AST constructor recursion depth mismatch" (round records, aggregation=median)."""
    most = most_parses_at_once(monkeypatch, 0.0005)
    run_in_process({"method": "fedavg", "num-server-rounds": 1, "local-epochs": 1})
    assert most == [1]


def test_a_clients_compute_description_travels_and_only_its_known_short_fields_are_kept():
    """What a client says of how it computes (a fit metric) is kept for results.json only as short
    known fields: anything else a client sends there (another type, too long, not JSON, nested,
    unknown keys, long strings) is left out, and never raises."""
    from protofl.federation.wire import decode_compute, encode_compute

    described = {"device": "cuda", "device_name": "NVIDIA H200", "autocast": "bf16", "memory_format": "channels-last",
                 "training_step": "captured", "threads": 1, "native_bf16": True, "amp": "auto", "channels_last": "auto"}
    sent = encode_compute(described)
    assert decode_compute(sent) == {k: v for k, v in described.items() if k not in ("amp", "channels_last")}
    for hostile in (None, 3, b"{}", "x" * 10_000, "not json", "[1, 2]", '{"device": {"nested": 1}}',
                    '{"device": "' + "c" * 200 + '"}', '{"threads": -1}', '{"threads": 1e308}', "[" * 400 + "]" * 400):
        assert decode_compute(hostile) in (None, {}), hostile
    assert decode_compute('{"device": "cpu", "evil": "x"}') == {"device": "cpu"}
