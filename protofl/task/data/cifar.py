"""CIFAR-10/100 in torchvision's on-disk format (``cifar-10-batches-py`` / ``cifar-100-python``):
pickled batch dicts, read by an unpickler that accepts numpy arrays and nothing else."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from protofl.task.data.images import ArraySplit, image_split


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Loads the CIFAR batch dicts (strings, lists, numpy arrays) and refuses any other global."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as handle:
        batch = _ArrayOnlyUnpickler(handle, encoding="latin1").load()  # as torchvision reads them
    data = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return data, np.asarray(batch[label_key], dtype=np.int64)


def _cifar_layout(num_classes: int) -> tuple[str, str, list[str], list[str]]:
    """(folder, label key, training files, test files) of torchvision's CIFAR-10/100 layout."""
    if num_classes == 10:
        return "cifar-10-batches-py", "labels", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
    return "cifar-100-python", "fine_labels", ["train"], ["test"]


def read_cifar_files(directory: Path, num_classes: int, which: str, require_all: bool = True) -> ArraySplit:
    """The ``which`` ("train" or "test") files of the CIFAR layout under ``directory``; with
    ``require_all=False``, whichever of them are there (at least one)."""
    folder, label_key, train_files, test_files = _cifar_layout(num_classes)
    root = directory / folder if (directory / folder).is_dir() else directory
    files = train_files if which == "train" else test_files
    present = [f for f in files if (root / f).is_file()]
    if not present or (require_all and len(present) < len(files)):
        missing = [f for f in files if f not in present]
        raise FileNotFoundError(f"{root} lacks {', '.join(missing)} (torchvision's {folder} layout)")
    parts = [_read_cifar_batch(root / f, label_key) for f in present]
    return image_split(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def load_cifar_dir(directory: Path, num_classes: int) -> tuple[ArraySplit, ArraySplit]:
    """torchvision's on-disk CIFAR-10/100 layout under ``directory``."""
    return read_cifar_files(directory, num_classes, "train"), read_cifar_files(directory, num_classes, "test")
