import io
import pickle

import numpy as np
import pytest

from protofl.strategies.base import ArraySpec, PayloadError, decode_array, encode_array

SPEC = ArraySpec((3, 4), ("float32",))
CAP = 1 << 20


def test_round_trip_keeps_values_dtype_and_shape():
    array = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    decoded = decode_array(encode_array(array), SPEC, CAP)
    assert decoded.dtype == np.float32 and decoded.shape == (3, 4)
    np.testing.assert_array_equal(decoded, array)


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
