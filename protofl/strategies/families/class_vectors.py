"""The class-vector family, FedProto's rule (Tan et al., AAAI 2022): the server averages the clients'
per-class vectors into global ones (Eq. 5) and broadcasts them; a client pulls its features toward
its label's global vector, and may classify by the nearest one.

FedProto is both halves; FedDistill's server averages logits so (:class:`ClassVectorAveraging`);
FedTGP's client trains so toward the prototypes its server trained (:class:`PrototypeLossClient`).
"""

from __future__ import annotations

import numpy as np
import torch

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import GLOBAL_PROTOTYPES, ClassVectors
from protofl.task.inference import head_prediction, nearest_prototype
from protofl.task.losses import prototype_loss
from protofl.task.prototypes import aggregate_prototypes


class ClassVectorAveraging(ServerRule):
    """Global vector of class c: the clients' vectors of c averaged as the options' ``weighting``
    says (Eq. 5); a class no client of the round holds has none. With a global model
    (``average-parameters``), the parameters are averaged too. Options: ``weighting`` and
    ``shares``."""

    state_fields = ("global_prototypes",)

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


class PrototypeLossClient(PrototypeClient):
    """Loss CE + lambda * MSE(feature, its label's global prototype); predictors: the head, and the
    nearest global prototype (among every class that has one, or, ``prototype-classes = "own"``, the
    classes of its own training split). Options: ``lambda_`` and ``prototype_classes``."""

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.received_prototypes = self.global_prototypes(this_round)
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
