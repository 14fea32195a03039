"""FedPer (Arivazhagan et al., 2019): the body is federated, each client keeps its own head.

Client: trains its whole model (its own head, restored from its node, under the body received) with
cross-entropy, as FedAvg; its head never leaves the node. Server: FedAvg over the body's entries
(``weighted = false``: unweighted, FedNH's code).

PM: the client's own head on the global body it receives (PFLlib's; FedNH's code scores the body the
client trained). GM: the aggregated body with the initial head, as FedNH's code scores FedPer (its
server never sees a trained head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.strategies.families.model_parts import BodyAveraging, BodySharing


@dataclass(frozen=True)
class FedPerOptions(BodySharing):
    capturable: ClassVar[bool] = True  # no batch loss


class FedPerStrategy(BodyAveraging):
    options_class = FedPerOptions


class FedPerClient(PrototypeClient):
    options_class = FedPerOptions


STRATEGY, CLIENT = FedPerStrategy, FedPerClient
