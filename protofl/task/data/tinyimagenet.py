"""Tiny-ImageNet: Stanford's ``tiny-imagenet-200`` folder (200 classes, 64x64 JPEGs;
``train/<wnid>/images/``, the labelled ``val/`` as the test set); no hub copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protofl.task.data.images import ArraySplit, image_split

NUM_CLASSES = 200


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
    if len(wnids) != NUM_CLASSES:
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
    splits = [image_split(_read_images([p for p, _ in pairs]), [y for _, y in pairs]) for pairs in (train, test)]
    return splits[0], splits[1]
