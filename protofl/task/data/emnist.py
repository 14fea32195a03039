"""EMNIST Balanced (47 classes, FedSKC): NIST's IDX files
``emnist-balanced-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]`` in a folder, its ``gzip/``
folder (NIST's zip layout) or ``EMNIST/raw/`` (torchvision's), else the same files from a Hugging
Face hub repository; images are stored transposed and are turned upright."""

from __future__ import annotations

from pathlib import Path

from protofl.task.data.idx import read_idx_split
from protofl.task.data.images import ArraySplit

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


def load_emnist_hub(repository: str) -> tuple[ArraySplit, ArraySplit]:
    from huggingface_hub import hf_hub_download

    try:
        paths = [Path(hf_hub_download(repository, name, repo_type="dataset")) for name in EMNIST_FILES]
    except Exception as err:  # no network, no cache, moved repository ...
        raise RuntimeError(
            f"could not download EMNIST from the Hugging Face hub repository {repository!r} "
            f"({err.__class__.__name__}: {err}); set the run config's data-dir to a local copy"
        ) from err
    return load_emnist_dir(paths[0].parent)
