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

from protofl.settings import KeptModel, MethodOptions
from protofl.strategies.families.class_vectors import ClassVectorAveraging, PrototypeLossClient
from protofl.task.prototypes import PrototypeWeighting
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


class FedProtoStrategy(ClassVectorAveraging):
    options_class = FedProtoOptions
    predictor_names = ("head", "prototype")


class FedProtoClient(PrototypeLossClient):
    options_class = FedProtoOptions


STRATEGY, CLIENT = FedProtoStrategy, FedProtoClient
