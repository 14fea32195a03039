"""IDX files (the MNIST family: Fashion-MNIST, EMNIST): unsigned-byte arrays behind a big-endian
header, optionally gzipped; the header is checked against the bytes that follow."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from protofl.task.data.images import ArraySplit, image_split


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) of unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file")
    if data[2] != 0x08:
        raise ValueError(f"{path}: only unsigned-byte IDX files are supported (type {data[2]:#x})")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = struct.unpack(">" + "I" * ndim, data[4:header])
    if len(data) - header != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {len(data) - header} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory} has no {stem}[.gz]")


def read_idx_split(directory: Path, prefix: str, transposed: bool = False) -> ArraySplit:
    """The ``<prefix>-images-idx3-ubyte`` / ``<prefix>-labels-idx1-ubyte`` pair (prefix train or
    t10k); ``transposed`` images (EMNIST's) are turned upright."""
    images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ValueError(f"{directory}: {len(images)} {prefix} images but {len(labels)} labels")
    return image_split(images.transpose(0, 2, 1) if transposed else images, labels)


def load_idx_dir(directory: Path) -> tuple[ArraySplit, ArraySplit]:
    """MNIST-format directory: train-/t10k- images-idx3 and labels-idx1 files."""
    return read_idx_split(directory, "train"), read_idx_split(directory, "t10k")
