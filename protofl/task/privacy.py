"""Differentially private prototypes: the client's clip-and-noise step and the accounting of it
(pure numpy; the accounting is Google's ``dp-accounting``, never a hand-written bound).

A client releases, per class it holds, one vector clipped to L2 norm ``clip`` plus Gaussian noise
of standard deviation ``noise * clip`` per coordinate. Replacing one training sample by another
of the same class moves one clipped vector by at most ``2 * clip``, so each release is a Gaussian
mechanism with noise multiplier ``noise / 2``; a client's releases over the rounds it trains
compose (RDP accountant). What this covers: the class vectors. What it does not: the class counts
and any shared model parameters, which travel as they are.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

import numpy as np


def privatize_class_means(
    means: np.ndarray, counts: np.ndarray, clip: float, noise: float, rng: np.random.Generator
) -> np.ndarray:
    """C x d class vectors -> each held class's row clipped to norm <= ``clip`` plus
    N(0, (noise * clip)^2) per coordinate (float32); rows of absent classes stay zero."""
    held = np.asarray(counts) > 0
    rows = means[held].astype(np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    rows = rows * np.minimum(1.0, clip / np.maximum(norms, 1e-12))
    rows = rows + rng.normal(0.0, noise * clip, size=rows.shape)
    private = np.zeros(means.shape, dtype=np.float32)
    private[held] = rows
    return private


def prototype_epsilon(noise: float, releases: int, delta: float) -> float:
    """epsilon at ``delta`` after ``releases`` rounds of :func:`privatize_class_means` with
    noise multiplier ``noise`` (relative to the clip norm); 0 without releases, inf without noise."""
    if releases == 0:
        return 0.0
    if noise <= 0:
        return float("inf")
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise / 2.0), releases)  # sensitivity 2 * clip
    return float(accountant.get_epsilon(delta))


class ReleaseLedger:
    """The rounds in which each partition released DP class vectors; the run's epsilon is its most
    frequent releaser's."""

    def __init__(self, releases: Mapping[str, int] | None = None) -> None:
        self.releases: Counter[int] = Counter({int(pid): int(n) for pid, n in (releases or {}).items()})

    def record(self, partitions: Iterable[int]) -> None:
        """One release by each of ``partitions``."""
        self.releases.update(partitions)

    def epsilon(self, noise: float, delta: float) -> float | None:
        """The run's epsilon at ``delta`` so far; None before any release."""
        return prototype_epsilon(noise, max(self.releases.values()), delta) if self.releases else None

    def state(self) -> dict[str, int]:
        """The release counts by partition (JSON keys), as :class:`ReleaseLedger` takes them back."""
        return {str(pid): count for pid, count in self.releases.items()}
