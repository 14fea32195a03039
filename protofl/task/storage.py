"""Files that survive a crash: atomic writes, and named arrays as bytes without pickle."""

from __future__ import annotations

import io
import os
import tempfile
import threading
from pathlib import Path
from typing import Mapping

import numpy as np

# numpy parses a .npy header with ast.literal_eval, and CPython 3.11's AST constructor is not
# thread-safe (its recursion depth is per interpreter, set from the calling thread's stack): two
# threads parsing at once raise "SystemError: AST constructor recursion depth mismatch". Every
# reader of .npy/.npz bytes holds this lock while numpy parses.
NUMPY_HEADER_LOCK = threading.Lock()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a part
    of one: a temporary file (mode 0600) in the same directory, fsynced, renamed over ``path``, and
    the directory fsynced so that the rename itself is on disk."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


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
