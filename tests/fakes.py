"""Stand-ins for Flower's runtime in strategy tests, and data files in real on-disk formats."""

import pickle

import numpy as np
from flwr.common import Code, Status
from flwr.server.client_proxy import ClientProxy

OK = Status(code=Code.OK, message="")


def uploads_class_statistics(method: str) -> bool:
    """Whether ``method``'s clients upload class statistics (prototypes, knowledge)."""
    from protofl.strategies import get_method

    return get_method(method)[0].options_class.statistics is not None


class FakeProxy(ClientProxy):
    def get_properties(self, ins, timeout, group_id): ...
    def get_parameters(self, ins, timeout, group_id): ...
    def fit(self, ins, timeout, group_id): ...
    def evaluate(self, ins, timeout, group_id): ...
    def reconnect(self, ins, timeout, group_id): ...


def start_round(strategy, sampled, num_partitions=None):
    """What configure_fit leaves behind: partitions 0..n-1 held by nodes "100", "101", ..., and the
    ``sampled`` ones asked to train."""
    sampled = list(sampled)
    n = num_partitions or max(sampled) + 1
    strategy.discovery.nodes = {p: FakeProxy(str(100 + p)) for p in range(n)}
    strategy.sampled = sampled
    strategy.admission.asked = {str(100 + p): p for p in sampled}


def write_cifar(root, num_classes, train_sizes, test_size, seed=0):
    """Random CIFAR-shaped images and labels in torchvision's on-disk layout under ``root`` (one
    training batch file per entry of ``train_sizes``); returns the batches by file name."""
    rng = np.random.default_rng(seed)
    folder = root / ("cifar-10-batches-py" if num_classes == 10 else "cifar-100-python")
    folder.mkdir()
    label_key = "labels" if num_classes == 10 else "fine_labels"
    names = [f"data_batch_{i + 1}" for i in range(len(train_sizes))] if num_classes == 10 else ["train"]
    batches = {}
    for name, size in list(zip(names, train_sizes)) + [("test_batch" if num_classes == 10 else "test", test_size)]:
        batch = {"data": rng.integers(0, 256, (size, 3072)).astype(np.uint8),
                 label_key: rng.integers(0, num_classes, size).tolist(), "filenames": [f"{i}.png" for i in range(size)]}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
        batches[name] = batch
    return batches
