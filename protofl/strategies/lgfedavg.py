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
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.strategies.families.model_parts import HeadSharing


@dataclass(frozen=True)
class LGFedAvgOptions(HeadSharing, ParameterAveraging):
    capturable: ClassVar[bool] = True  # no batch loss


class LGFedAvgStrategy(AveragingStrategy):
    options_class = LGFedAvgOptions


class LGFedAvgClient(PrototypeClient):
    options_class = LGFedAvgOptions


STRATEGY, CLIENT = LGFedAvgStrategy, LGFedAvgClient
