"""The parameter-averaging family: the server averages the clients' shared model entries, weighted by
their training sizes (FedAvg, McMahan et al., 2017) or unweighted, under the run's ``aggregation``
rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from protofl.federation.admission import ClientUpdate
from protofl.federation.server_rule import ServerRule
from protofl.settings import KeptModel, MethodOptions


@dataclass(frozen=True)
class ParameterAveraging(MethodOptions):
    """The options of a method whose server averages the clients' models as FedAvg's does (FedProx,
    MOON, FedNTD, FedRCL): its clients upload parameters only."""

    statistics: ClassVar[None] = None  # parameters only
    weighted: bool = True  # by local training size; false: unweighted


@dataclass(frozen=True)
class GlobalModelAveraging(ParameterAveraging):
    """A method whose clients all train the one global model (FedAvg, CReFF): PM scores it on each
    client's test split (``personal-model = "global"``, PFLlib's), or the client's model right after
    its local training (``"local"``, FedNH's convention for FedAvg's PM)."""

    personal_model: Literal["global", "local"] = "global"

    @property
    def keeps_model(self) -> KeptModel:
        return "scores" if self.personal_model == "local" else None


class AveragingStrategy(ServerRule):
    """The new shared entries: the clients' mean, by training size unless ``weighted = false``."""

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        return self.average_parameters(updates, None if self.options.weighted else [1] * len(updates))
