"""The Hugging Face hub copies of a data set, through flwr-datasets (when no local files are given;
it needs the network or a filled hub cache)."""

from __future__ import annotations

import numpy as np

from protofl.task.data.images import ArraySplit, image_split


def arrays_from_hf(split, image_key: str, label_key: str) -> ArraySplit:
    """A ``datasets.Dataset`` with PIL (or array) images -> ArraySplit."""
    images = np.stack([np.asarray(img, dtype=np.uint8) for img in split[image_key]])
    return image_split(images, np.asarray(split[label_key]))


def load_hub(hub_name: str, image_key: str, label_key: str) -> tuple[ArraySplit, ArraySplit]:
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
