"""Each client's data as tensors on its device: its partition of the training pool
(:func:`load_client_data`), or, in a deployment where each node holds its own files, those files
whole (:func:`load_local_client_data`); and what a partition holds, as the server works it out from
its own copy of the data set (:func:`partition_sizes`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protofl.task.data.cifar import read_cifar_files
from protofl.task.data.idx import read_idx_split
from protofl.task.data.images import ArraySplit, check_labels, renormalised
from protofl.task.data.registry import DATASETS, load_dataset, load_global_test, training_pool
from protofl.task.partition import PartitionSpec, client_split, partition_indices


@dataclass(frozen=True)
class ClientData:
    """One client's local train and test split, as tensors on the training device."""

    partition_id: int
    num_classes: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_test(self) -> int:
        return len(self.test_y)

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[2])

    def class_counts(self) -> np.ndarray:
        """Training samples per class (length ``num_classes``)."""
        return np.bincount(self.train_y.cpu().numpy(), minlength=self.num_classes).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _partitions(name: str, data_dir: str, spec: PartitionSpec) -> tuple[np.ndarray, ...]:
    return tuple(partition_indices(training_pool(name, data_dir, spec).labels, spec))


@functools.lru_cache(maxsize=256)
def load_client_data(
    name: str, data_dir: str, spec: PartitionSpec, partition_id: int, device: str = "cpu"
) -> ClientData:
    """One client's data, split and moved to ``device`` once per process."""
    if not 0 <= partition_id < spec.num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {spec.num_partitions})")
    num_classes = DATASETS[name][0]
    partition = _partitions(name, data_dir, spec)[partition_id]
    data = _client_data(training_pool(name, data_dir, spec), num_classes, partition, spec, partition_id, device)
    if spec.test_fraction > 0:
        return data
    # no local test split: scored on the global test set (the same tensors for every client)
    test_x, test_y = load_global_test(name, data_dir, device, normalisation=spec.normalisation)
    return dataclasses.replace(data, test_x=test_x, test_y=test_y)


@dataclass(frozen=True)
class PartitionSizes:
    """What a partition holds, as the server can work it out from its own copy of the data set."""

    train_counts: np.ndarray  # training samples per class (int64)
    num_test: int


@functools.lru_cache(maxsize=1024)
def partition_sizes(name: str, data_dir: str, spec: PartitionSpec, partition_id: int) -> PartitionSizes:
    """The class counts and test size :func:`load_client_data` gives a partition, without loading it."""
    labels = training_pool(name, data_dir, spec).labels
    partition = _partitions(name, data_dir, spec)[partition_id]
    train_idx, test_idx = client_split(labels, partition, spec, partition_id)
    num_test = len(test_idx) if spec.test_fraction > 0 else len(load_dataset(name, data_dir, spec.normalisation).test)
    return PartitionSizes(np.bincount(labels[train_idx], minlength=DATASETS[name][0]).astype(np.int64), num_test)


LOCAL_DATA_FORMATS = ("fmnist", "cifar10", "cifar100")


@functools.lru_cache(maxsize=16)
def load_local_client_data(
    name: str, data_dir: str, spec: PartitionSpec, partition_id: int, device: str = "cpu"
) -> ClientData:
    """A node's own data, used whole: a deployment where every node already holds its data.

    ``data_dir`` holds training files in the data set's on-disk format: the IDX
    ``train-images-idx3-ubyte[.gz]`` / ``train-labels-idx1-ubyte[.gz]`` pair for ``fmnist``, one
    or more of the CIFAR training batches for ``cifar10`` / ``cifar100``. They are split per class
    into local train and test with ``spec``'s test fraction and seed, like a partition.
    """
    if name not in LOCAL_DATA_FORMATS:
        raise ValueError(f"local-data-dir works with {LOCAL_DATA_FORMATS}, not {name!r}")
    if spec.test_fraction <= 0 or spec.pool != "train":
        raise ValueError("local-data-dir splits the node's own files: it needs test-fraction > 0 and pool='train'")
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"local-data-dir {directory} does not exist")
    num_classes = DATASETS[name][0]
    if name == "fmnist":
        split = read_idx_split(directory, "train")
    else:
        split = read_cifar_files(directory, num_classes, "train", require_all=False)
    check_labels(name, num_classes, split)
    split = renormalised(split, name, spec.normalisation)
    return _client_data(split, num_classes, np.arange(len(split)), spec, partition_id, device)


def _client_data(
    pool: ArraySplit, num_classes: int, samples: np.ndarray, spec: PartitionSpec, partition_id: int, device: str
) -> ClientData:
    """``samples`` of ``pool`` split per class into local train/test, as tensors on ``device``."""
    train_idx, test_idx = client_split(pool.labels, samples, spec, partition_id)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return ClientData(
        partition_id=partition_id,
        num_classes=num_classes,
        train_x=tensor(pool.images[train_idx]),
        train_y=tensor(pool.labels[train_idx]),
        test_x=tensor(pool.images[test_idx]),
        test_y=tensor(pool.labels[test_idx]),
    )
