"""FedNTD (Lee et al., NeurIPS 2022): federated not-true distillation.

Client: the loss of each mini-batch is CE + beta * L_NTD (Eq. 5 of the paper), with
L_NTD = tau^2 * KL( softmax(q~_glob / tau) || softmax(q~ / tau) ) (Eq. 4) summed over the classes and
averaged over the batch, where q~ and q~_glob are the local and the global model's logits without
the sample's true class (the not-true logits, in class order), the global model the one received
this round, frozen and in eval mode (as PFLlib and the authors' code). The term's batch mean is
uploaded as ``ntd-loss``.

Server: FedAvg, the parameters averaged by training size (the paper's FedAvg; ``weighted = false``:
unweighted, PFLlib's ``serverntd``).

Defaults: tau = 1, beta = 1 (the authors' configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.losses import at_least_float32
from protofl.task.weights import all_tensors

NTD_LOSS = "ntd-loss"


@dataclass(frozen=True)
class FedNTDOptions(ParameterAveraging):
    beta: float = 1.0
    temperature: float = 1.0  # tau

    capturable: ClassVar[bool] = True  # the not-true logits by a fixed-shape gather: no host sync

    def check(self) -> None:
        if self.beta < 0:
            raise ValueError(f"fedntd.beta must be >= 0, got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"fedntd.temperature must be > 0, got {self.temperature}")


def not_true_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """B x (C - 1): each row without its label's column, the others in class order."""
    classes = logits.shape[1]
    others = torch.arange(classes - 1, device=logits.device).expand(len(labels), -1)
    return logits.gather(1, others + (others >= labels[:, None]).long())


def not_true_distillation(
    logits: torch.Tensor, global_logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    """L_NTD (Eq. 4): tau^2 KL(global || local) of the not-true softmaxes at temperature tau, summed
    over the classes and averaged over the batch, in float32 at least."""
    logits, global_logits = at_least_float32(logits), at_least_float32(global_logits)
    log_local = F.log_softmax(not_true_logits(logits, labels) / temperature, dim=1)
    log_global = F.log_softmax(not_true_logits(global_logits, labels) / temperature, dim=1)
    divergence = (log_global.exp() * (log_global - log_local)).sum(dim=1).mean()
    return temperature**2 * divergence


class FedNTDStrategy(AveragingStrategy):
    options_class = FedNTDOptions
    loss_metrics = (NTD_LOSS,)


class FedNTDClient(PrototypeClient):
    options_class = FedNTDOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.global_model = self.frozen_copy().eval()

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # PM: the global model, as FedAvg's (no reference copy to build)

    def batch_loss(self, features, logits, labels, inputs):
        with torch.no_grad():
            _, global_logits = self.global_model(inputs)
        ntd = not_true_distillation(logits, global_logits, labels, self.options.temperature)
        self.record_loss(**{NTD_LOSS: ntd})
        return self.options.beta * ntd  # Eq. 5

    def step_constants(self):
        return ()

    def step_inputs(self):
        return {f"global/{k}": v for k, v in all_tensors(self.global_model).items()}


STRATEGY, CLIENT = FedNTDStrategy, FedNTDClient
