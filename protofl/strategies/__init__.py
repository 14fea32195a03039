"""Method registry: ``method`` in the run config -> (Strategy class, NumPyClient class).

Each method lives whole in its own module, which defines ``STRATEGY`` and ``CLIENT``.
"""

from __future__ import annotations

import importlib

METHODS = ("fedavg", "fedproto")


def get_method(name: str):
    """(Strategy class, client class) of a method."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    module = importlib.import_module(f"protofl.strategies.{name}")
    return module.STRATEGY, module.CLIENT
