"""FedAvg (McMahan et al., 2017): sample-weighted parameter averaging.

GM is the global model on the global test set. PM is, by default, the same global model scored
on each client's local test split (PFLlib's convention for global-model methods);
``personal-model = "local"`` scores instead the client's model right after its local training
(FedNH's convention for FedAvg's PM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.strategies.families.averaging import AveragingStrategy, GlobalModelAveraging


@dataclass(frozen=True)
class FedAvgOptions(GlobalModelAveraging):
    capturable: ClassVar[bool] = True  # no batch loss


class FedAvgStrategy(AveragingStrategy):
    options_class = FedAvgOptions


class FedAvgClient(PrototypeClient):
    options_class = FedAvgOptions


STRATEGY, CLIENT = FedAvgStrategy, FedAvgClient
