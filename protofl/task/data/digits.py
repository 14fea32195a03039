"""scikit-learn's 1,797 8x8 digits (embedded, offline), upsampled to 16x16; a fixed stratified 80/20
split gives the global test set."""

from __future__ import annotations

import numpy as np
import torch

from protofl.task.data.images import ArraySplit
from protofl.task.partition import stratified_split


def load_digits_splits() -> tuple[ArraySplit, ArraySplit]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)[:, None]
    x = torch.nn.functional.interpolate(x, size=16, mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).numpy()
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, test_fraction=0.2, seed=0)  # fixed: same test set for every run
    return ArraySplit(x[train], y[train]), ArraySplit(x[test], y[test])
