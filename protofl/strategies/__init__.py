"""Method registry: ``method`` in the run config -> (Strategy class, client class).

Each method lives whole in its own module, which defines ``STRATEGY`` (its server rule, a
:class:`~protofl.federation.server_rule.ServerRule`) and ``CLIENT`` (its client rule, a
:class:`~protofl.federation.client.PrototypeClient`), neither a Flower class, sharing one
:class:`~protofl.settings.MethodOptions`, and optionally ``prepare_model(model, settings)`` when it
changes the backbone (e.g. FedNH's head). docs/adding-a-method.md walks through one.
"""

from __future__ import annotations

import importlib

from protofl.federation.server import legacy_strategy
from protofl.settings import ExperimentSettings
from protofl.task.data import ClientData, Dataset
from protofl.task.models import SplitModel, build_model, client_architecture

METHODS = ("fedavg", "fedproto", "fednh", "fedcosr", "fedsa", "fedsc", "fedskc",
           "fedprox", "moon", "scaffold", "fedopt", "fedntd", "fedrcl", "fedcda",
           "local", "fedper", "fedrep", "fedbabu", "fedrod", "ditto", "creff",
           "lgfedavg", "feddistill", "fml", "fedkd", "fedgen", "fedtgp", "fedgh",
           "pfedme", "perfedavg", "fedamp", "fedala", "fedpac")


def _module(name: str):
    if name not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    return importlib.import_module(f"protofl.strategies.{name}")


def method_rule(name: str) -> type:
    """A method's server rule (:class:`~protofl.federation.server_rule.ServerRule`), of no front."""
    return _module(name).STRATEGY


def get_method(name: str):
    """(Strategy class, client class) of a method: its server rule on the legacy Flower front
    (:func:`~protofl.federation.server.legacy_strategy`), and its client."""
    module = _module(name)
    return legacy_strategy(module.STRATEGY), module.CLIENT


def build_method_model(
    settings: ExperimentSettings, dataset: Dataset | ClientData, architecture: str | None = None
) -> SplitModel:
    """The configured backbone with the method's changes; identical on the server and every client
    (a client takes the shapes from its own data).

    With a model family (``model = "htfe2"``) a client builds its member (partition id mod X) and
    the server the first; ``architecture`` (a node's ``model`` node-config value) overrides both.
    """
    partition_id = dataset.partition_id if isinstance(dataset, ClientData) else 0
    name = architecture or client_architecture(settings.model, partition_id)
    model = build_model(name, dataset.in_channels, dataset.num_classes, dataset.image_size, settings.seed)
    prepare = getattr(_module(settings.method), "prepare_model", None)
    return prepare(model, settings) if prepare is not None else model
