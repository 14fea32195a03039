"""The data sets protofl knows, each loaded once per process from its on-disk format (or the hub),
normalised; the pool that is partitioned across clients, and the global test set."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protofl.task.data.cifar import load_cifar_dir
from protofl.task.data.digits import load_digits_splits
from protofl.task.data.emnist import load_emnist_dir, load_emnist_hub
from protofl.task.data.hub import load_hub
from protofl.task.data.idx import load_idx_dir
from protofl.task.data.images import ArraySplit, check_labels, renormalised
from protofl.task.data.tinyimagenet import load_tinyimagenet_dir
from protofl.task.partition import PartitionSpec

DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# name -> (number of classes, hub name, hub image column, hub label column)
DATASETS = {
    "digits": (10, None, None, None),
    "fmnist": (10, "zalando-datasets/fashion_mnist", "image", "label"),
    "emnist": (47, "Royc30ne/emnist-balanced", None, None),  # a hub repository of NIST's IDX files
    "cifar10": (10, "uoft-cs/cifar10", "img", "label"),
    "cifar100": (100, "uoft-cs/cifar100", "img", "fine_label"),
    "tinyimagenet": (200, None, None, None),
}
# name -> (channels, image size, training images, test images) as loaded: the shapes to generate
# stand-in data of, without the files (benchmarks/throughput.py)
SHAPES = {
    "digits": (1, 16, 1438, 359),
    "fmnist": (1, 28, 60_000, 10_000),
    "emnist": (1, 28, 112_800, 18_800),
    "cifar10": (3, 32, 50_000, 10_000),
    "cifar100": (3, 32, 50_000, 10_000),
    "tinyimagenet": (3, 64, 100_000, 10_000),
}


@dataclass(frozen=True)
class Dataset:
    name: str
    num_classes: int
    train: ArraySplit  # the pool that is partitioned across clients
    test: ArraySplit  # the global test set (GM)

    @property
    def in_channels(self) -> int:
        return int(self.train.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train.images.shape[2])


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", normalisation: str = "half") -> Dataset:
    """Load a dataset once per process (cached by name, data-dir and normalisation)."""
    dataset = _load(name, data_dir)
    train, test = (renormalised(split, name, normalisation) for split in (dataset.train, dataset.test))
    return Dataset(name, dataset.num_classes, train, test)


def _load(name: str, data_dir: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}")
    num_classes, hub_name, image_key, label_key = DATASETS[name]
    directory = Path(data_dir).expanduser() if data_dir else None
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"data-dir {directory} does not exist")
    if name == "digits":
        train, test = load_digits_splits()
    elif name == "fmnist":
        if directory is None and DEBIAN_FMNIST_DIR.is_dir():
            directory = DEBIAN_FMNIST_DIR
        train, test = load_idx_dir(directory) if directory else load_hub(hub_name, image_key, label_key)
    elif name == "emnist":
        train, test = load_emnist_dir(directory) if directory else load_emnist_hub(hub_name)
    elif name == "tinyimagenet":
        if directory is None:
            raise ValueError("tinyimagenet has no hub copy here: set data-dir to the tiny-imagenet-200 folder")
        train, test = load_tinyimagenet_dir(directory)
    else:
        train, test = (
            load_cifar_dir(directory, num_classes) if directory else load_hub(hub_name, image_key, label_key)
        )
    for split in (train, test):
        check_labels(name, num_classes, split)
    return Dataset(name, num_classes, train, test)


def training_pool(name: str, data_dir: str, spec: PartitionSpec) -> ArraySplit:
    """What is partitioned: the training set, or training and test set merged (``pool``)."""
    dataset = load_dataset(name, data_dir, spec.normalisation)
    return dataset.train if spec.pool == "train" else _merged(name, data_dir, spec.normalisation)


@functools.lru_cache(maxsize=2)
def _merged(name: str, data_dir: str, normalisation: str) -> ArraySplit:
    dataset = load_dataset(name, data_dir, normalisation)
    train, test = dataset.train, dataset.test
    return ArraySplit(np.concatenate([train.images, test.images]), np.concatenate([train.labels, test.labels]))


@functools.lru_cache(maxsize=4)
def load_global_test(
    name: str, data_dir: str, device: str = "cpu", per_class: int = 0, normalisation: str = "half"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global test set as tensors on ``device``; ``per_class > 0`` keeps only the first
    ``per_class`` images of each class (a smaller, still balanced, set)."""
    test = load_dataset(name, data_dir, normalisation).test
    keep = np.arange(len(test))
    if per_class > 0:
        keep = np.concatenate([np.flatnonzero(test.labels == c)[:per_class] for c in np.unique(test.labels)])
        keep.sort()
    return torch.from_numpy(test.images[keep]).to(device), torch.from_numpy(test.labels[keep]).to(device)
