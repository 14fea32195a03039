"""The model-parts family: a client's model is a body and a head (``SplitModel``); one of them is
shared, the other stays on the client's node (:attr:`~protofl.settings.MethodOptions.keeps_model`)
and is loaded under what it receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from protofl.settings import KeptModel, MethodOptions
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging

HEAD = "head."  # the state_dict entries of the classifier (SplitModel.head)


@dataclass(frozen=True)
class BodySharing(ParameterAveraging):
    """A method whose clients share the body and keep their heads (FedPer, FedRep, FedBABU, FedPAC)."""

    keeps_model: ClassVar[KeptModel] = "trains"  # its head; the body is loaded over it

    def shares(self, name: str) -> bool:
        return not name.startswith(HEAD)


@dataclass(frozen=True)
class HeadSharing(MethodOptions):
    """A method whose clients share the head and keep their bodies (LG-FedAvg, FedGen, FedGH): any
    architecture whose features have the run's size."""

    keeps_model: ClassVar[KeptModel] = "trains"  # its body; the head is loaded over it
    shares_across_architectures: ClassVar[bool] = True

    def shares(self, name: str) -> bool:
        return name.startswith(HEAD)


class BodyAveraging(AveragingStrategy):
    """FedAvg over the shared entries; GM: them with the initial head (FedNH's code scores FedPer so:
    its server never sees a trained head)."""

    def global_model_weights(self, shared: list[np.ndarray]) -> list[np.ndarray] | None:
        return self.with_initial_entries(shared)
