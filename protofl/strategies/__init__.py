"""Method registry: ``method`` in the run config -> (Strategy class, NumPyClient class).

Each method lives whole in its own module, which defines ``STRATEGY`` and ``CLIENT``, and
optionally ``prepare_model(model, config)`` when it changes the backbone (e.g. FedNH's head).
"""

from __future__ import annotations

import importlib

from protofl.config import ExperimentConfig
from protofl.task.data import ClientData, Dataset
from protofl.task.models import SplitModel, build_model

METHODS = ("fedavg", "fedproto", "fednh", "fedcosr")


def _module(name: str):
    if name not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    return importlib.import_module(f"protofl.strategies.{name}")


def get_method(name: str):
    """(Strategy class, client class) of a method."""
    module = _module(name)
    return module.STRATEGY, module.CLIENT


def build_method_model(config: ExperimentConfig, dataset: Dataset | ClientData) -> SplitModel:
    """The configured backbone with the method's changes; identical on the server and every client
    (a client takes the shapes from its own data)."""
    model = build_model(config.model, dataset.in_channels, dataset.num_classes, dataset.image_size, config.seed)
    prepare = getattr(_module(config.method), "prepare_model", None)
    return prepare(model, config) if prepare is not None else model
