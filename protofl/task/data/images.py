"""Images as the loaders return them: float32 N x C x H x W, normalised, with int64 labels.

Every reader turns uint8 pixels into floats through :func:`image_split` (mean 0.5, std 0.5 per
channel: [-1, 1], as PFLlib); ``normalisation="dataset"`` then maps them to the data set's own
channel statistics (:func:`renormalised`), as FedNH's and FedSKC's code do for CIFAR and
Tiny-ImageNet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def normalised(images_uint8: np.ndarray) -> np.ndarray:
    """uint8 N x H x W (x C) -> float32 N x C x H x W in [-1, 1]."""
    x = images_uint8.astype(np.float32) / 255.0
    if x.ndim == 3:
        x = x[:, None]
    else:
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray((x - 0.5) / 0.5)


def image_split(images_uint8: np.ndarray, labels) -> ArraySplit:
    return ArraySplit(normalised(images_uint8), np.asarray(labels, dtype=np.int64))


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


def renormalised(split: ArraySplit, name: str, normalisation: str) -> ArraySplit:
    """``split`` (mean 0.5, std 0.5) mapped to ``normalisation``'s statistics."""
    if normalisation == "half":
        return split
    mean, std = (a[None, :, None, None] for a in channel_stats(name, normalisation))
    return ArraySplit(((split.images * 0.5 + 0.5 - mean) / std).astype(np.float32), split.labels)


def check_labels(name: str, num_classes: int, split: ArraySplit) -> None:
    if len(split) == 0 or split.labels.min() < 0 or split.labels.max() >= num_classes:
        raise ValueError(f"{name}: no samples, or labels outside [0, {num_classes})")
