"""FedAvg (McMahan et al., 2017): sample-weighted parameter averaging.

GM is the global model on the global test set. PM is, by default, the same global model scored
on each client's local test split (PFLlib's convention for global-model methods);
``personal-model = "local"`` scores instead the client's model right after its local training
(FedNH's convention for FedAvg's PM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from protofl.federation.client import PrototypeClient
from protofl.federation.server import ClientUpdate, PrototypeStrategy
from protofl.settings import KeptModel, MethodOptions


@dataclass(frozen=True)
class ParameterAveraging(MethodOptions):
    """The options of a method whose server averages the clients' models as FedAvg's does (FedProx,
    MOON, FedNTD, FedRCL): its clients upload parameters only."""

    statistics: ClassVar[None] = None  # parameters only
    weighted: bool = True  # by local training size; false: unweighted


@dataclass(frozen=True)
class FedAvgOptions(ParameterAveraging):
    personal_model: Literal["global", "local"] = "global"

    capturable: ClassVar[bool] = True  # no batch loss

    @property
    def keeps_model(self) -> KeptModel:
        return "scores" if self.personal_model == "local" else None


class FedAvgStrategy(PrototypeStrategy):
    options_class = FedAvgOptions

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        return self.average_parameters(updates, None if self.options.weighted else [1] * len(updates))


class FedAvgClient(PrototypeClient):
    options_class = FedAvgOptions


STRATEGY, CLIENT = FedAvgStrategy, FedAvgClient
