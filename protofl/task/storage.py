"""Files that survive a crash: atomic writes, and named arrays as bytes without pickle."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import queue
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

LOGGER = logging.getLogger(__name__)  # the standard library's: protofl.task imports no Flower

# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's AST constructor is not
# thread-safe (its recursion depth is per interpreter, set from the calling thread's stack): two
# threads parsing at once raise "SystemError: AST constructor recursion depth mismatch". Every
# reader of .npy/.npz bytes holds this lock while numpy parses.
NUMPY_HEADER_LOCK = threading.Lock()


def atomic_write(path: Path, data: bytes | Sequence[bytes | memoryview], *, durable: bool = True) -> None:
    """Write ``data`` (or its parts, one after another) to ``path`` so that a crash leaves the old
    file or the new one, never a part of one: a temporary file (mode 0600) in the same directory,
    fsynced, renamed over ``path``, and the directory fsynced so that the rename itself is on disk.

    ``durable=False``: the file is renamed into place unsynced (other processes see it at once, and
    it survives the writer's kill) and fsynced on a background thread (:func:`sync_later`); until
    that is done, a crash of the machine may lose it or leave it unreadable. For a file whose
    durability someone else ensures before it matters (a client's state, which the simulation's
    server syncs before its checkpoint: :func:`sync_files`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            for part in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                handle.write(part)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)
    else:
        sync_later(path)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_files(paths: Sequence[Path]) -> None:
    """fsync each file of ``paths`` and then each of their directories; a file that is gone (a
    version deleted since) is skipped. Already synced files cost a system call each."""
    directories = set()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        directories.add(Path(path).parent)
    for directory in directories:
        with contextlib.suppress(FileNotFoundError):
            _fsync_directory(directory)


class _BackgroundSync:
    """One daemon thread per process that fsyncs the files :func:`sync_later` hands it, in order."""

    def __init__(self) -> None:
        self.pending: queue.Queue[Path] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, path: Path) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="protofl-sync", daemon=True)
                self.thread.start()
        self.pending.put(path)

    def _run(self) -> None:
        while True:
            path = self.pending.get()
            try:
                sync_files([path])
            except OSError as err:  # the file's own durability is then the reader's concern
                LOGGER.warning("protofl: fsync of %s failed (%s)", path, err)


_background = _BackgroundSync()


def sync_later(path: Path) -> None:
    """fsync ``path`` and its directory on this process's background thread."""
    _background.submit(Path(path))


def remove_partial_writes(directory: Path) -> None:
    """Delete the temporary files that writes interrupted by a crash left in ``directory``."""
    for partial in Path(directory).glob(".*.tmp"):
        partial.unlink(missing_ok=True)


def arrays_to_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named arrays as one ``.npz`` blob."""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.asarray(value) for name, value in arrays.items()})
    return buffer.getvalue()


def arrays_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` blob, read without pickle (an object array is a ``ValueError``)."""
    with NUMPY_HEADER_LOCK, np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}


# Named arrays as a flat blob: BLOB_MAGIC, the header's length (8 bytes, little-endian), the header
# (JSON: [name, dtype, shape, offset] per array, offsets from the end of the header), then each
# array's bytes in C order at a 64-byte-aligned offset. Written from the arrays' own memory and read
# as views of the bytes read: no zip, CRC or per-array copy (a client's state is its whole model,
# written and read every round; .npz cost tv-resnet18's 43 MB about 100 ms each way on a 2-core VM).
BLOB_MAGIC = b"PROTOFL-ARRAYS-1"
_ALIGN = 64
_BLOB_KINDS = "biuf"  # booleans, integers, floats: never an object array


def array_blob_parts(arrays: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """``arrays`` as the parts of one blob (:func:`arrays_from_blob` reads their concatenation)."""
    header, data, offset = [], [], 0
    for name, value in arrays.items():
        array = np.asarray(value)
        array = array if array.flags.c_contiguous else array.copy(order="C")
        if array.dtype.kind not in _BLOB_KINDS:
            raise ValueError(f"array {name!r} has dtype {array.dtype}: only booleans, integers and floats")
        padding = -offset % _ALIGN
        data += [bytes(padding), memoryview(array.reshape(-1)).cast("B")]
        offset += padding
        header.append([name, array.dtype.str, list(array.shape), offset])
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(len(BLOB_MAGIC) + 8 + len(encoded)) % _ALIGN)
    return [BLOB_MAGIC, len(encoded).to_bytes(8, "little"), encoded, *data]


def arrays_to_blob(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as one blob (see :func:`array_blob_parts`)."""
    return b"".join(array_blob_parts(arrays))


def arrays_from_blob(data: bytes | bytearray) -> dict[str, np.ndarray]:
    """The arrays of a blob, as views of ``data`` (writable when ``data`` is a bytearray). Anything
    else than a blob of booleans, integers and floats inside ``data`` is a ``ValueError``."""
    start = len(BLOB_MAGIC) + 8
    if bytes(data[:len(BLOB_MAGIC)]) != BLOB_MAGIC or len(data) < start:
        raise ValueError("not an array blob")
    base = start + int.from_bytes(data[len(BLOB_MAGIC):start], "little")
    if base > len(data):
        raise ValueError("a damaged array blob header")
    try:
        header = json.loads(bytes(data[start:base]))
        arrays = {}
        for name, dtype, shape, offset in header:
            dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
            count = math.prod(shape)
            if (not isinstance(name, str) or name in arrays or dtype.kind not in _BLOB_KINDS
                    or min(shape, default=0) < 0 or offset < 0 or base + offset + count * dtype.itemsize > len(data)):
                raise ValueError(f"array {name!r}: dtype {dtype}, shape {shape}, offset {offset} in {len(data)} bytes")
            arrays[name] = np.frombuffer(data, dtype, count, base + offset).reshape(shape)
    except (TypeError, OverflowError, json.JSONDecodeError) as err:
        raise ValueError(f"a damaged array blob header: {err}") from err
    return arrays


def read_file(path: Path) -> bytearray:
    """The file's bytes, read into one writable buffer."""
    with open(path, "rb") as handle:
        data = bytearray(os.fstat(handle.fileno()).st_size)
        if handle.readinto(data) != len(data):
            raise OSError(f"{path} changed while being read")
    return data
