"""LG-FedAvg (Liang et al., 2020): local representations, a global classifier.

Client: trains its whole model (its own body, kept on its node, under the head received) with
cross-entropy; the body never leaves the node, so every client may run its own architecture (a
model family). Server: FedAvg over the head's entries (weighted by training size, HtFLlib's).

PM: the client's own body with the global head (HtFLlib's, whose server sends the head to every
client before scoring). No GM: the bodies stay on the clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.settings import KeptModel, MethodOptions
from protofl.strategies.fedavg import FedAvgStrategy, ParameterAveraging
from protofl.strategies.fedper import HEAD


@dataclass(frozen=True)
class HeadSharing(MethodOptions):
    """A method whose clients share the head and keep their bodies (LG-FedAvg, FedGen, FedGH): any
    architecture whose features have the run's size."""

    keeps_model: ClassVar[KeptModel] = "trains"  # its body; the head is loaded over it
    shares_across_architectures: ClassVar[bool] = True

    def shares(self, name: str) -> bool:
        return name.startswith(HEAD)


@dataclass(frozen=True)
class LGFedAvgOptions(HeadSharing, ParameterAveraging):
    capturable: ClassVar[bool] = True  # no batch loss


class LGFedAvgStrategy(FedAvgStrategy):
    options_class = LGFedAvgOptions


class LGFedAvgClient(PrototypeClient):
    options_class = LGFedAvgOptions


STRATEGY, CLIENT = LGFedAvgStrategy, LGFedAvgClient
