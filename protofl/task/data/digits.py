"""scikit-learn's 1,797 8x8 digits (embedded, offline), upsampled to 16x16; a fixed stratified 80/20
split gives the global test set."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from protofl.task.data.images import ArraySplit
from protofl.task.partition import stratified_split


def digits_pixels() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images (N x 8 x 8, values 0..16, float64) and labels (int64), as
    ``sklearn.datasets.load_digits`` gives them, read from the file it reads: importing scikit-learn
    costs 2-4 s on 2 cores, paid by every process that loads the data set (each Ray actor, each
    ClientApp process of a deployment); finding its directory imports nothing."""
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is None or not csv.is_file():  # another layout: ask scikit-learn
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target.astype(np.int64)
    table = np.loadtxt(csv, delimiter=",")  # 64 pixels, then the label
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def load_digits_splits() -> tuple[ArraySplit, ArraySplit]:
    images, y = digits_pixels()
    x = torch.from_numpy(images.astype(np.float32) / 16.0)[:, None]
    x = torch.nn.functional.interpolate(x, size=16, mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).numpy()
    train, test = stratified_split(y, test_fraction=0.2, seed=0)  # fixed: same test set for every run
    return ArraySplit(x[train], y[train]), ArraySplit(x[test], y[test])
