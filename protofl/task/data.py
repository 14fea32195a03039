"""Datasets as ready arrays, loaded once per process, and each client's data as tensors.

Sources:
- ``digits``: scikit-learn's 1,797 8x8 digits (embedded, offline), upsampled to 16x16; a fixed
  stratified 80/20 split gives the global test set.
- ``fmnist``: the IDX files in ``data-dir`` (e.g. ``/usr/share/datasets/fashion-mnist`` from
  Debian's ``dataset-fashion-mnist``, which is also tried when ``data-dir`` is empty), else the
  Hugging Face hub copy through flwr-datasets.
- ``emnist``: EMNIST Balanced (47 classes, FedSKC): NIST's IDX files
  ``emnist-balanced-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]`` in ``data-dir`` (or its
  ``gzip/`` folder, NIST's zip layout, or ``EMNIST/raw/``, torchvision's), else the same files
  from the Hugging Face hub; images are stored transposed and are turned upright.
- ``cifar10`` / ``cifar100``: torchvision's on-disk format under ``data-dir``
  (``cifar-10-batches-py`` / ``cifar-100-python``), else the hub copy through flwr-datasets.
- ``tinyimagenet``: Stanford's ``tiny-imagenet-200`` folder under ``data-dir`` (200 classes,
  64x64 JPEGs; ``train/<wnid>/images/``, the labelled ``val/`` as the test set); no hub copy.

Images are float32 N x C x H x W. ``normalisation="half"`` maps every pixel to [-1, 1] (mean 0.5,
std 0.5 per channel, as PFLlib); ``"dataset"`` uses the data set's own channel statistics, as
FedNH's and FedSKC's code do for CIFAR and Tiny-ImageNet. With ``pool="train+test"`` the official
train and test sets are merged before partitioning (PFLlib's convention: FedSA, FedCoSR); there is
then no global test set. With ``test-fraction=0`` a client has no local test split and is scored
on the whole global test set instead (FedNH's protocol).

A client's data is its partition of the training pool (``load_client_data``), or, in a
deployment where each node holds its own files, those files whole (``load_local_client_data``);
``cached_on_disk`` keeps it on the node between the per-message processes of a deployment.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import logging
import pickle
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from protofl.task.partition import PartitionSpec, client_split, partition_indices, stratified_split
from protofl.task.storage import arrays_to_bytes, atomic_write

LOGGER = logging.getLogger(__name__)  # the standard library's: protofl.task imports no Flower
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
# per-channel (mean, std) of pixel values in [0, 1], for normalisation="dataset" (FedNH's code)
CHANNEL_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.507, 0.487, 0.441), (0.267, 0.256, 0.276)),
    "tinyimagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}


@dataclass(frozen=True)
class ArraySplit:
    images: np.ndarray  # float32, N x C x H x W, normalised
    labels: np.ndarray  # int64, N

    def __len__(self) -> int:
        return len(self.labels)


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


def _normalise(images_uint8: np.ndarray) -> np.ndarray:
    """uint8 N x H x W (x C) -> float32 N x C x H x W in [-1, 1]."""
    x = images_uint8.astype(np.float32) / 255.0
    if x.ndim == 3:
        x = x[:, None]
    else:
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray((x - 0.5) / 0.5)


def _split(images_uint8: np.ndarray, labels) -> ArraySplit:
    return ArraySplit(_normalise(images_uint8), np.asarray(labels, dtype=np.int64))


def channel_stats(name: str, normalisation: str) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) per channel that ``normalisation`` maps a data set's [0, 1] pixels with."""
    if normalisation == "half":
        return np.array([0.5], np.float32), np.array([0.5], np.float32)
    if name not in CHANNEL_STATS:
        raise ValueError(f"normalisation='dataset' has statistics for {sorted(CHANNEL_STATS)}, not {name!r}")
    mean, std = CHANNEL_STATS[name]
    return np.array(mean, np.float32), np.array(std, np.float32)


def black_level(name: str, normalisation: str) -> np.ndarray:
    """Per channel, the value a black pixel has after normalisation (the fill of padded crops)."""
    mean, std = channel_stats(name, normalisation)
    return -mean / std


def _renormalised(split: ArraySplit, name: str, normalisation: str) -> ArraySplit:
    """``split`` (mean 0.5, std 0.5) mapped to ``normalisation``'s statistics."""
    if normalisation == "half":
        return split
    mean, std = (a[None, :, None, None] for a in channel_stats(name, normalisation))
    return ArraySplit(((split.images * 0.5 + 0.5 - mean) / std).astype(np.float32), split.labels)


# --- digits ------------------------------------------------------------------------------


def _load_digits() -> tuple[ArraySplit, ArraySplit]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)[:, None]
    x = torch.nn.functional.interpolate(x, size=16, mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).numpy()
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, test_fraction=0.2, seed=0)  # fixed: same test set for every run
    return ArraySplit(x[train], y[train]), ArraySplit(x[test], y[test])


# --- IDX (MNIST family) ----------------------------------------------------------------


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
    return _split(images.transpose(0, 2, 1) if transposed else images, labels)


def load_idx_dir(directory: Path) -> tuple[ArraySplit, ArraySplit]:
    """MNIST-format directory: train-/t10k- images-idx3 and labels-idx1 files."""
    return read_idx_split(directory, "train"), read_idx_split(directory, "t10k")


EMNIST_PREFIX = "emnist-balanced"
EMNIST_FILES = [
    f"{EMNIST_PREFIX}-{split}-{kind}-ubyte.gz" for split in ("train", "test") for kind in ("images-idx3", "labels-idx1")
]


def load_emnist_dir(directory: Path) -> tuple[ArraySplit, ArraySplit]:
    """EMNIST Balanced from NIST's IDX files in ``directory``, its ``gzip/`` or its ``EMNIST/raw/``."""
    for folder in (directory, directory / "gzip", directory / "EMNIST" / "raw"):
        try:
            train = read_idx_split(folder, f"{EMNIST_PREFIX}-train", transposed=True)
            return train, read_idx_split(folder, f"{EMNIST_PREFIX}-test", transposed=True)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{directory} (or its gzip/, EMNIST/raw/) has no {EMNIST_PREFIX}-train/test IDX files")


def _load_emnist_hub(repository: str) -> tuple[ArraySplit, ArraySplit]:
    from huggingface_hub import hf_hub_download

    try:
        paths = [Path(hf_hub_download(repository, name, repo_type="dataset")) for name in EMNIST_FILES]
    except Exception as err:  # no network, no cache, moved repository ...
        raise RuntimeError(
            f"could not download EMNIST from the Hugging Face hub repository {repository!r} "
            f"({err.__class__.__name__}: {err}); set the run config's data-dir to a local copy"
        ) from err
    return load_emnist_dir(paths[0].parent)


# --- CIFAR (torchvision's python pickles) ------------------------------------------------


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
    return _split(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def load_cifar_dir(directory: Path, num_classes: int) -> tuple[ArraySplit, ArraySplit]:
    """torchvision's on-disk CIFAR-10/100 layout under ``directory``."""
    return read_cifar_files(directory, num_classes, "train"), read_cifar_files(directory, num_classes, "test")


# --- Tiny-ImageNet (Stanford's folder of JPEGs) -----------------------------------------


def _read_images(paths: list[Path]) -> np.ndarray:
    from PIL import Image

    def read(path: Path) -> np.ndarray:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)

    return np.stack([read(path) for path in paths]) if paths else np.empty((0, 64, 64, 3), np.uint8)


def load_tinyimagenet_dir(directory: Path) -> tuple[ArraySplit, ArraySplit]:
    """``tiny-imagenet-200`` under ``directory`` (or ``directory`` itself): ``wnids.txt``, the training
    images ``train/<wnid>/images/*.JPEG`` and the labelled validation set (``val/images`` with
    ``val/val_annotations.txt``) as the test set. Class ids follow the sorted wnids."""
    root = directory / "tiny-imagenet-200" if (directory / "tiny-imagenet-200").is_dir() else directory
    if not (root / "wnids.txt").is_file():
        raise FileNotFoundError(f"{root} has no wnids.txt (Stanford's tiny-imagenet-200 layout)")
    wnids = sorted(root.joinpath("wnids.txt").read_text().split())
    if len(wnids) != DATASETS["tinyimagenet"][0]:
        raise ValueError(f"{root / 'wnids.txt'} lists {len(wnids)} classes, not 200")
    label_of = {wnid: i for i, wnid in enumerate(wnids)}
    train = [(path, label_of[w]) for w in wnids for path in sorted((root / "train" / w / "images").glob("*.JPEG"))]
    test = []
    for line in root.joinpath("val", "val_annotations.txt").read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 2:
            if fields[1] not in label_of:
                raise ValueError(f"val_annotations.txt: {fields[0]} has the unknown class {fields[1]!r}")
            test.append((root / "val" / "images" / fields[0], label_of[fields[1]]))
    splits = [_split(_read_images([p for p, _ in pairs]), [y for _, y in pairs]) for pairs in (train, test)]
    return splits[0], splits[1]


# --- Hugging Face hub through flwr-datasets ---------------------------------------------


def arrays_from_hf(split, image_key: str, label_key: str) -> ArraySplit:
    """A ``datasets.Dataset`` with PIL (or array) images -> ArraySplit."""
    images = np.stack([np.asarray(img, dtype=np.uint8) for img in split[image_key]])
    return _split(images, np.asarray(split[label_key]))


def _load_hub(hub_name: str, image_key: str, label_key: str) -> tuple[ArraySplit, ArraySplit]:
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import IidPartitioner

    try:
        fds = FederatedDataset(dataset=hub_name, partitioners={"train": IidPartitioner(1)})
        train, test = fds.load_split("train"), fds.load_split("test")
    except Exception as err:  # no network, no cache, renamed dataset ...
        raise RuntimeError(
            f"could not load {hub_name!r} from the Hugging Face hub ({err.__class__.__name__}: "
            f"{err}); set the run config's data-dir to a local copy"
        ) from err
    return arrays_from_hf(train, image_key, label_key), arrays_from_hf(test, image_key, label_key)


# --- public API --------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", normalisation: str = "half") -> Dataset:
    """Load a dataset once per process (cached by name, data-dir and normalisation)."""
    dataset = _load(name, data_dir)
    train, test = (_renormalised(split, name, normalisation) for split in (dataset.train, dataset.test))
    return Dataset(name, dataset.num_classes, train, test)


def _load(name: str, data_dir: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}")
    num_classes, hub_name, image_key, label_key = DATASETS[name]
    directory = Path(data_dir).expanduser() if data_dir else None
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"data-dir {directory} does not exist")
    if name == "digits":
        train, test = _load_digits()
    elif name == "fmnist":
        if directory is None and DEBIAN_FMNIST_DIR.is_dir():
            directory = DEBIAN_FMNIST_DIR
        train, test = load_idx_dir(directory) if directory else _load_hub(hub_name, image_key, label_key)
    elif name == "emnist":
        train, test = load_emnist_dir(directory) if directory else _load_emnist_hub(hub_name)
    elif name == "tinyimagenet":
        if directory is None:
            raise ValueError("tinyimagenet has no hub copy here: set data-dir to the tiny-imagenet-200 folder")
        train, test = load_tinyimagenet_dir(directory)
    else:
        train, test = (
            load_cifar_dir(directory, num_classes) if directory else _load_hub(hub_name, image_key, label_key)
        )
    for split in (train, test):
        _check_labels(name, num_classes, split)
    return Dataset(name, num_classes, train, test)


def _check_labels(name: str, num_classes: int, split: ArraySplit) -> None:
    if len(split) == 0 or split.labels.min() < 0 or split.labels.max() >= num_classes:
        raise ValueError(f"{name}: no samples, or labels outside [0, {num_classes})")


def training_pool(name: str, data_dir: str, spec: PartitionSpec) -> ArraySplit:
    """What is partitioned: the training set, or training and test set merged (``pool``)."""
    dataset = load_dataset(name, data_dir, spec.normalisation)
    return dataset.train if spec.pool == "train" else _merged(name, data_dir, spec.normalisation)


@functools.lru_cache(maxsize=2)
def _merged(name: str, data_dir: str, normalisation: str) -> ArraySplit:
    dataset = load_dataset(name, data_dir, normalisation)
    train, test = dataset.train, dataset.test
    return ArraySplit(np.concatenate([train.images, test.images]), np.concatenate([train.labels, test.labels]))


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
    _check_labels(name, num_classes, split)
    split = _renormalised(split, name, spec.normalisation)
    return _client_data(split, num_classes, np.arange(len(split)), spec, partition_id, device)


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
    stored = np.load(path, allow_pickle=False)
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise ValueError("not an .npz archive")
    with stored:
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
