"""Datasets as ready arrays, loaded once per process, and each client's data as tensors.

Sources, one module per on-disk format, each reader next to its own checks:
- ``digits`` (:mod:`.digits`): scikit-learn's 1,797 8x8 digits (embedded, offline), upsampled to
  16x16; a fixed stratified 80/20 split gives the global test set.
- ``fmnist`` (:mod:`.idx`): the IDX files in ``data-dir`` (e.g. ``/usr/share/datasets/fashion-mnist``
  from Debian's ``dataset-fashion-mnist``, which is also tried when ``data-dir`` is empty), else the
  Hugging Face hub copy through flwr-datasets (:mod:`.hub`).
- ``emnist`` (:mod:`.emnist`): EMNIST Balanced (47 classes, FedSKC), NIST's IDX files in
  ``data-dir``, else the same files from the Hugging Face hub.
- ``cifar10`` / ``cifar100`` (:mod:`.cifar`): torchvision's on-disk format under ``data-dir``
  (``cifar-10-batches-py`` / ``cifar-100-python``), else the hub copy through flwr-datasets.
- ``tinyimagenet`` (:mod:`.tinyimagenet`): Stanford's ``tiny-imagenet-200`` folder under
  ``data-dir``; no hub copy.

Images are float32 N x C x H x W, normalised in one place (:mod:`.images`): ``"half"`` maps every
pixel to [-1, 1] (mean 0.5, std 0.5 per channel, as PFLlib); ``"dataset"`` uses the data set's own
channel statistics, as FedNH's and FedSKC's code do for CIFAR and Tiny-ImageNet. The registry
(:mod:`.registry`) loads a data set once per process. With ``pool="train+test"`` the official train
and test sets are merged before partitioning (PFLlib's convention: FedSA, FedCoSR); there is then no
global test set. With ``test-fraction=0`` a client has no local test split and is scored on the
whole global test set instead (FedNH's protocol).

A client's data (:mod:`.clients`) is its partition of the training pool (``load_client_data``), or,
in a deployment where each node holds its own files, those files whole (``load_local_client_data``);
``cached_on_disk`` (:mod:`.node_cache`) keeps it on the node between the per-message processes of a
deployment.
"""

from protofl.task.data.cifar import load_cifar_dir, read_cifar_files
from protofl.task.data.clients import (
    LOCAL_DATA_FORMATS,
    ClientData,
    PartitionSizes,
    load_client_data,
    load_local_client_data,
    partition_sizes,
)
from protofl.task.data.emnist import load_emnist_dir
from protofl.task.data.hub import arrays_from_hf
from protofl.task.data.idx import load_idx_dir, read_idx, read_idx_split
from protofl.task.data.images import CHANNEL_STATS, ArraySplit, black_level, channel_stats
from protofl.task.data.node_cache import cached_on_disk
from protofl.task.data.registry import (
    DATASETS,
    SHAPES,
    Dataset,
    load_dataset,
    load_global_test,
    training_pool,
)
from protofl.task.data.tinyimagenet import load_tinyimagenet_dir

__all__ = [
    "CHANNEL_STATS", "DATASETS", "LOCAL_DATA_FORMATS", "SHAPES", "ArraySplit", "ClientData", "Dataset",
    "PartitionSizes", "arrays_from_hf", "black_level", "cached_on_disk", "channel_stats", "load_cifar_dir",
    "load_client_data", "load_dataset", "load_emnist_dir", "load_global_test", "load_idx_dir",
    "load_local_client_data", "load_tinyimagenet_dir", "partition_sizes", "read_cifar_files", "read_idx",
    "read_idx_split", "training_pool",
]
