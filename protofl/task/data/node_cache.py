"""A node's data kept on its disk between the per-message ClientApp processes of a deployment
(:func:`cached_on_disk`), read back as untrusted input."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from protofl.task.data.clients import ClientData
from protofl.task.storage import NUMPY_HEADER_LOCK, arrays_to_bytes, atomic_write

LOGGER = logging.getLogger(__name__)  # the standard library's: protofl.task imports no Flower

NODE_CACHE_VERSION = 1


def _source_fingerprint(data_dir: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of the files under ``data_dir`` (two levels: CIFAR's sub-folder)."""
    directory = Path(data_dir).expanduser() if data_dir else None
    if directory is None or not directory.is_dir():
        return []
    files = [f for pattern in ("*", "*/*") for f in directory.glob(pattern) if f.is_file()]
    return sorted((str(f.relative_to(directory)), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


NODE_CACHE_ARRAYS = ("train_x", "train_y", "test_x", "test_y")
# atomic_write's temporary files for a cache file; one older than this was left by a killed process
NODE_CACHE_PARTIAL = re.compile(r"\.client-data-[0-9a-f]{24}\.npz\.[a-z0-9_]+\.tmp")
NODE_CACHE_STALE_SECONDS = 3600


def _checked_node_cache(path: Path, partition_id: int, num_classes: int) -> dict[str, np.ndarray]:
    """The arrays of a node cache file, read as untrusted input; a ``ValueError`` says what is wrong
    (reading may raise other errors too: a truncated or foreign file)."""
    with NUMPY_HEADER_LOCK:
        stored = np.load(path, allow_pickle=False)
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise ValueError("not an .npz archive")
    with NUMPY_HEADER_LOCK, stored:
        if sorted(stored.files) != sorted([*NODE_CACHE_ARRAYS, "partition_id", "num_classes"]):
            raise ValueError(f"arrays {sorted(stored.files)}")
        arrays = {name: stored[name] for name in stored.files}  # an object array is a ValueError
    for name, expected in (("partition_id", partition_id), ("num_classes", num_classes)):
        value = arrays[name]
        if value.shape != () or value.dtype.kind not in "iu" or int(value) != expected:
            raise ValueError(f"{name} {value!r}, expected {expected}")
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.dtype != np.float32 or x.ndim != 4 or y.dtype != np.int64 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{split} arrays {x.dtype} {x.shape} and {y.dtype} {y.shape}, "
                             "not float32 N x C x H x W and int64 N")
        if not np.isfinite(x).all():
            raise ValueError(f"{split} images with non-finite values")
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{split} labels outside [0, {num_classes})")
    if arrays["train_x"].shape[1:] != arrays["test_x"].shape[1:]:
        raise ValueError(f"train images {arrays['train_x'].shape[1:]}, test images {arrays['test_x'].shape[1:]}")
    return arrays


def _remove_stale_partial_writes(directory: Path) -> None:
    """Delete the temporary files of cache writes whose process was killed (``kill -9``): those
    with a cache file's name, unchanged for an hour (a younger one may be a write under way)."""
    cutoff = time.time() - NODE_CACHE_STALE_SECONDS
    for partial in directory.iterdir():
        if NODE_CACHE_PARTIAL.fullmatch(partial.name):
            try:
                if partial.lstat().st_mtime < cutoff:
                    partial.unlink()
            except OSError:
                pass  # removed meanwhile by another process, or not a file


def cached_on_disk(
    cache_dir: str, key: tuple, data_dir: str, load: Callable[[], ClientData], device: str, *,
    partition_id: int, num_classes: int,
) -> ClientData:
    """``load()`` once per node, then its arrays from ``cache_dir``.

    In a deployment every message starts a fresh ClientApp process, so the in-process caches
    above do not last past one round; this file does. ``key`` names what decides the data (data
    set, partition settings, partition id); the files in ``data_dir`` are fingerprinted too, so
    changed data is loaded anew. The file is written atomically into a directory of mode 0700
    (mode 0600: it is raw training data). It is read as untrusted input: without pickle, and checked
    (names, dtypes, shapes, finite images, labels in ``[0, num_classes)``, ``partition_id``); a file
    that fails is logged, deleted, and the data loaded and written again.
    """
    digest = hashlib.sha256(repr((NODE_CACHE_VERSION, key, _source_fingerprint(data_dir))).encode()).hexdigest()
    directory = Path(cache_dir).expanduser()
    path = directory / f"client-data-{digest[:24]}.npz"
    if path.is_file():
        try:
            arrays = _checked_node_cache(path, partition_id, num_classes)
        except Exception as error:  # whatever the file's bytes make the reader raise: load anew
            LOGGER.warning("protofl: node cache %s rejected (%s: %s); loading the data again",
                           path, type(error).__name__, error)
            path.unlink(missing_ok=True)
        else:
            tensors = [torch.from_numpy(arrays[name]).to(device) for name in NODE_CACHE_ARRAYS]
            return ClientData(partition_id, num_classes, *tensors)
    data = load()
    arrays = {name: getattr(data, name).cpu().numpy() for name in NODE_CACHE_ARRAYS}
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing one is left as it is
    _remove_stale_partial_writes(directory)
    # concurrent writers of the same key write the same arrays
    atomic_write(path, arrays_to_bytes(arrays | {"partition_id": data.partition_id, "num_classes": data.num_classes}))
    return data
