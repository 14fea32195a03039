"""MOON (Li, He and Song, CVPR 2021): model-contrastive federated learning.

Client: the loss of each mini-batch is CE + mu * l_con (Eq. 3 of the paper), with
l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )
(Eq. 2) averaged over the batch: z the model's feature of a sample (its body's output, as PFLlib's
``model.base``; the paper's projection head is not used), z_glob that of the global model received this
round and z_prev that of the client's own model after its last training (before it has trained: the
initial model, as PFLlib), both frozen; sim the cosine similarity. The reference models run in
training mode, as PFLlib's (with BatchNorm: batch statistics). The term's batch mean is uploaded as
``contrastive-loss``. The client keeps its model after each fit, for the next round's z_prev.

Server: FedAvg, the parameters averaged by training size (``weighted = false``: unweighted).

Defaults: tau = 0.5 and mu = 1 (the paper's, and its code's; the paper runs mu = 5 on CIFAR-10,
presets/*-cifar10-* say so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.federation.wire import CONTRASTIVE_LOSS
from protofl.settings import KeptModel
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.weights import all_tensors



@dataclass(frozen=True)
class MOONOptions(ParameterAveraging):
    keeps_model: ClassVar[KeptModel] = "kept"  # z_prev's model
    mu: float = 1.0
    temperature: float = 0.5

    capturable: ClassVar[bool] = True  # fixed shapes, no host sync

    def check(self) -> None:
        if self.mu < 0:
            raise ValueError(f"moon.mu must be >= 0, got {self.mu}")
        if self.temperature <= 0:
            raise ValueError(f"moon.temperature must be > 0, got {self.temperature}")


def model_contrastive_loss(
    features: torch.Tensor, global_features: torch.Tensor, previous_features: torch.Tensor, temperature: float
) -> torch.Tensor:
    """l_con (Eq. 2) of each sample: cross-entropy of [sim(z, z_glob), sim(z, z_prev)] / tau with the
    global model's feature the positive."""
    positive = F.cosine_similarity(features, global_features, dim=1)
    negative = F.cosine_similarity(features, previous_features, dim=1)
    logits = torch.stack([positive, negative], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(features), dtype=torch.long, device=features.device),
                           reduction="none")


class MOONStrategy(AveragingStrategy):
    options_class = MOONOptions
    loss_metrics = (CONTRASTIVE_LOSS,)


class MOONClient(PrototypeClient):
    options_class = MOONOptions

    def receive(self, parameters, this_round):
        self.previous_model = self.frozen_copy(self.stored_model())  # its last trained model, or the initial one
        self.load_shared(parameters)
        self.global_model = self.frozen_copy()

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # PM: the global model, as FedAvg's

    def batch_loss(self, features, logits, labels, inputs):
        with torch.no_grad():
            global_features, _ = self.global_model.train()(inputs)
            previous_features, _ = self.previous_model.train()(inputs)
        contrastive = model_contrastive_loss(features, global_features, previous_features,
                                             self.options.temperature).mean()  # Eq. 2
        self.record_loss(**{CONTRASTIVE_LOSS: contrastive})
        return self.options.mu * contrastive  # Eq. 3

    def step_constants(self):
        return ()

    def step_inputs(self):
        tensors = {f"global/{k}": v for k, v in all_tensors(self.global_model).items()}
        return tensors | {f"previous/{k}": v for k, v in all_tensors(self.previous_model).items()}


STRATEGY, CLIENT = MOONStrategy, MOONClient
