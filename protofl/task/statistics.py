"""Class statistics of a client's training split: per-class means and counts of its vectors, from
an eval pass or summed on the device while it trains (the uploads of prototype methods)."""

from __future__ import annotations

from typing import Callable, Literal

import numpy as np
import torch

# where local prototypes come from: an eval pass after training, or the training-mode vectors seen
# in training (every epoch, or the last one)
PrototypePass = Literal["post-eval", "during-train", "last-epoch"]
PostOrLastEpochPass = Literal["post-eval", "last-epoch"]


def class_means(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class mean feature (C x d float32, zero rows for absent classes) and class counts."""
    counts = torch.bincount(labels, minlength=num_classes)
    sums = torch.zeros(num_classes, features.shape[1], device=features.device, dtype=features.dtype)
    sums.index_add_(0, labels, features)
    means = sums / counts.clamp(min=1).unsqueeze(1).to(features.dtype)
    return means.float().cpu().numpy(), counts.cpu().numpy().astype(np.int64)


class FeatureSums:
    """Per-class sums and counts of the (detached) vectors a training loop sees, e.g. from its
    ``extra_loss``: the training-mode prototypes of FedSA's, HtFLlib's FedProto and FedSC's code.
    The first ``skip`` batches are not counted (``skip`` = the steps before the last epoch: the
    last epoch only)."""

    def __init__(self, num_classes: int, dim: int, device: torch.device, skip: int = 0) -> None:
        self.sums = torch.zeros(num_classes, dim, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)
        self.skip = skip
        self.batches = torch.zeros((), dtype=torch.long, device=device)  # seen so far, counted on the device

    def step_key(self) -> tuple:
        return tuple(self.sums.shape), self.sums.dtype, self.skip

    def reset(self) -> None:
        for tensor in (self.sums, self.counts, self.batches):
            tensor.zero_()

    def take(self, other: FeatureSums) -> None:
        for tensor, kept in ((self.sums, other.sums), (self.counts, other.counts), (self.batches, other.batches)):
            tensor.copy_(kept)

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch, on the device and without waiting for the host (a captured step replays it)."""
        counted = torch.ones_like(labels)
        features = features.detach().to(self.sums.dtype)
        if self.skip > 0:  # the batch counts once ``skip`` batches have gone by
            past_skip = self.batches >= self.skip
            features, counted = torch.where(past_skip, features, 0.0), counted * past_skip
            self.batches.add_(1)
        self.sums.index_add_(0, labels, features)
        self.counts.index_add_(0, labels, counted)

    def means(self) -> np.ndarray:
        """C x d float32 mean features (the wire's dtype, whatever the sums'); zero rows for classes
        never seen."""
        return (self.sums / self.counts.clamp(min=1).unsqueeze(1)).float().cpu().numpy()

    def means_filled(self, held: np.ndarray, fallback: Callable[[], np.ndarray]) -> np.ndarray:
        """:meth:`means`, with the rows of ``held`` classes never seen (all their samples in skipped
        batches) taken from ``fallback()``, called only when there are such rows."""
        means = self.means()
        missing = held & (self.counts.cpu().numpy() == 0)
        if missing.any():
            means[missing] = fallback()[missing]
        return means
