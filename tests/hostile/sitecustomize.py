"""Test only: turns the ClientApp of the process that imports this into a hostile one.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the hostile-deployment test puts this
directory on ``PYTHONPATH`` of one SuperNode's ClientApp SuperExec only, so it also reaches the
``flwr-clientapp`` processes that SuperExec starts (they inherit its environment). Nothing here is
part of ``protofl``, and nothing happens in a process that never imports
``protofl.federation.client``.

A meta-path finder wraps the loader of ``protofl.federation.client`` (wherever it is loaded from:
the FAB's directory or the checkout, and again on a reload), so that right after the module runs,
``PrototypeClient.fit`` is replaced. Every fit of this node then trains honestly and uploads, with
the attacks ``HOSTILE_ATTACKS`` names for its round (``"1:scale+inflate,2:scale"``; a round not
named gets ``scale+inflate``):

- ``scale``: class means multiplied by ``HOSTILE_SCALE`` (default 1e6), as big-endian ``>f4``
  arrays, and every float model array likewise (FedProto without average-parameters shares none);
- ``inflate``: ``num_examples`` = ``HOSTILE_NUM_EXAMPLES`` (default 10**12), with the int64 class
  counts raised so that they add up to it exactly (they pass the "counts sum to num_examples" check);
- ``lie``: the partition id ``HOSTILE_LIED_PARTITION`` (default 0: an honest node's) instead of its own.

Each hostile fit writes a JSON marker into ``HOSTILE_MARKER_DIR`` (when set), so a test can tell the
patch really ran.
"""

from __future__ import annotations

import importlib.abc
import io
import json
import os
import sys

TARGET = "protofl.federation.client"


def _npy(array) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)  # keeps the byte order in the header ('>f4')
    return buffer.getvalue()


def _round_attacks(server_round: int) -> set[str]:
    schedule = {}
    for item in filter(None, os.environ.get("HOSTILE_ATTACKS", "").split(",")):
        rounds, _, names = item.partition(":")
        schedule[int(rounds)] = set(filter(None, names.split("+")))
    unknown = set().union(*schedule.values()) - {"scale", "inflate", "lie"} if schedule else set()
    if unknown:
        raise ValueError(f"unknown hostile attacks {sorted(unknown)}")
    return schedule.get(server_round, {"scale", "inflate"})


def _poison(arrays, num_examples, metrics, config, module_file=None):
    import numpy as np

    scale = float(os.environ.get("HOSTILE_SCALE", "1e6"))
    claimed = int(os.environ.get("HOSTILE_NUM_EXAMPLES", str(10**12)))
    server_round = int(config.get("server-round", 1))
    wanted = _round_attacks(server_round)
    metrics = dict(metrics)
    own_partition = metrics.get("partition-id")
    attacks = []

    if "scale" in wanted:
        arrays = [(np.asarray(a) * scale).astype(np.asarray(a).dtype.newbyteorder(">"))
                  if np.asarray(a).dtype.kind == "f" else a for a in arrays]
        if arrays:
            attacks.append("parameters-scaled-big-endian")
        if "class-means" in metrics:
            means = np.load(io.BytesIO(metrics["class-means"]), allow_pickle=False)
            metrics["class-means"] = _npy((means * scale).astype(">f4"))
            attacks.append("class-means-scaled-big-endian")
    if "inflate" in wanted:
        if "class-counts" in metrics:
            counts = np.load(io.BytesIO(metrics["class-counts"]), allow_pickle=False).astype(np.int64)
            held = counts > 0
            raised = np.zeros_like(counts)
            raised[held] = claimed // int(held.sum())
            raised[np.argmax(counts)] += claimed - int(raised.sum())  # exactly `claimed` in all
            metrics["class-counts"] = _npy(raised.astype(np.int64))
            attacks.append("class-counts-raised")
        num_examples = claimed
        attacks.append("num-examples-inflated")
    if "lie" in wanted:
        metrics["partition-id"] = int(os.environ.get("HOSTILE_LIED_PARTITION", "0"))
        attacks.append("partition-id-lied")

    marker_dir = os.environ.get("HOSTILE_MARKER_DIR")
    if marker_dir:
        os.makedirs(marker_dir, exist_ok=True)
        marker = {"round": server_round, "own-partition": own_partition, "sent-partition": metrics.get("partition-id"),
                  "num-examples": num_examples, "attacks": attacks, "pid": os.getpid(), "module": module_file}
        with open(os.path.join(marker_dir, f"fit-round-{server_round}-{os.getpid()}.json"), "w") as file:
            json.dump(marker, file)
    return arrays, num_examples, metrics


def _make_hostile(module) -> None:
    client_class = getattr(module, "PrototypeClient", None)
    if client_class is None or getattr(client_class.fit, "_hostile", False):
        return
    honest_fit = client_class.fit

    def fit(self, parameters, config):
        arrays, num_examples, metrics = honest_fit(self, parameters, config)
        return _poison(arrays, num_examples, metrics, config, getattr(module, "__file__", None))

    fit._hostile = True
    client_class.fit = fit


class _HostileLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _make_hostile(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)


class _HostileFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _HostileLoader):
                    spec.loader = _HostileLoader(spec.loader)
                return spec
        return None


if not any(isinstance(finder, _HostileFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _HostileFinder())
if TARGET in sys.modules:
    _make_hostile(sys.modules[TARGET])
