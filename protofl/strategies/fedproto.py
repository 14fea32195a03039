"""FedProto (Tan et al., AAAI 2022): clients share class prototypes instead of models.

Client: loss = CE + lambda * MSE(feature, global prototype of its label) (per-sample form of the
official code and PFLlib); after training, per-class mean features from an eval pass over the
local training split (``prototype-pass = "post-eval"``; ``"during-train"``: of the training-mode
features seen in training, as the official code and HtFLlib), and the class counts, go up as
bytes. The model is personal and kept in ``context.state``.

Server: global prototype of class c = average of the client prototypes of c, weighted by the
clients' counts of c (Eq. 5, ``weighting = "count"``) or unweighted over the clients holding c
(``"uniform"``, as PFLlib). Classes no client of this round holds get no global prototype.
``average-parameters = true`` also averages the models (FedAvg + prototype loss), giving a GM.

Inference: nearest global prototype (``inference = "prototype"``, the reported PM) and the
classifier head; both are logged. The nearest prototype is sought among every class with a global
prototype (``prototype-classes = "all"``, as PFLlib), or among the classes of the client's own
training split only (``"own"``, the original code's test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from protofl.federation.client import PrototypeClient
from protofl.federation.server import ClientUpdate, PrototypeStrategy, stacked_statistics
from protofl.federation.wire import GLOBAL_PROTOTYPES, ClassVectors
from protofl.settings import KeptModel, MethodOptions
from protofl.task.prototypes import PrototypeWeighting, aggregate_prototypes
from protofl.task.inference import head_prediction, nearest_prototype
from protofl.task.statistics import PrototypePass


@dataclass(frozen=True)
class FedProtoOptions(MethodOptions):
    lambda_: float = 1.0  # weight of the prototype MSE term (key "lambda")
    weighting: PrototypeWeighting = "count"
    average_parameters: bool = False
    inference: Literal["prototype", "head"] = "prototype"
    prototype_pass: PrototypePass = "post-eval"
    prototype_classes: Literal["all", "own"] = "all"

    capturable: ClassVar[bool] = True  # prototype_loss: fixed shapes, no host sync

    @property
    def keeps_model(self) -> KeptModel:
        return None if self.average_parameters else "trains"  # the personal model

    def shares(self, name: str) -> bool:
        return self.average_parameters


def prototype_loss(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """MSE between each feature and its label's global prototype, averaged over batch x d.

    Samples whose class has no global prototype contribute zero (as PFLlib's FedProto).
    """
    has_prototype = mask[labels].unsqueeze(1).to(features.dtype)
    return ((features - prototypes[labels]) ** 2 * has_prototype).sum() / features.numel()


class FedProtoStrategy(PrototypeStrategy):
    options_class = FedProtoOptions
    state_fields = ("global_prototypes",)
    predictor_names = ("head", "prototype")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.global_prototypes: ClassVectors | None = None

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.global_prototypes.to_config(GLOBAL_PROTOTYPES) if self.global_prototypes else {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray] | None:
        prototypes, mask = aggregate_prototypes(  # Eq. 5
            *stacked_statistics(updates), self.options.weighting, **self.prototype_rule
        )
        self.global_prototypes = ClassVectors(prototypes, mask)
        return self.average_parameters(updates) if self.has_global_model else None


class FedProtoClient(PrototypeClient):
    options_class = FedProtoOptions

    def receive(self, parameters, config):
        self.load_shared(parameters)
        self.received_prototypes = self.global_prototypes(config)
        if self.received_prototypes is not None and self.options.prototype_classes == "own":
            # only this client's classes may be predicted; its training labels are all among them,
            # so the prototype loss is unchanged
            prototypes, available = self.received_prototypes
            held = torch.from_numpy(self.data.class_counts() > 0).to(available.device)
            self.received_prototypes = (prototypes, available & held)

    def batch_loss(self, features, logits, labels, inputs):
        if self.received_prototypes is None or self.options.lambda_ <= 0:
            return None
        return self.options.lambda_ * prototype_loss(features, labels, *self.received_prototypes)

    def step_constants(self):
        return self.received_prototypes is None

    def step_inputs(self):
        if self.received_prototypes is None:
            return {}
        prototypes, available = self.received_prototypes
        return {"received_prototypes": prototypes, "available_classes": available}

    def predictors(self):
        predictors = {"head": head_prediction}
        if self.received_prototypes is not None:
            predictors["prototype"] = lambda f, _logits: nearest_prototype(f, *self.received_prototypes)
        return predictors


STRATEGY, CLIENT = FedProtoStrategy, FedProtoClient
