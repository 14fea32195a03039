"""FedProx (Li et al., MLSys 2020): FedAvg whose clients stay near the global model they received.

Client: each local step minimises h(w) = CE(w) + (mu / 2) ||w - w^t||^2 (Eq. 2 of the paper),
w^t the global model of the round, over every trainable parameter. Its gradient, grad CE +
mu (w - w^t), is PFLlib's (its optimiser adds mu (w - w^t) to each gradient, ``PerturbedGradientDescent``):
the same step under plain SGD. The proximal term's batch mean is uploaded as ``proximal-loss``.

Server: FedAvg, the parameters averaged by training size (the paper's and PFLlib's;
``weighted = false``: unweighted).

``mu``: 0.01 by default (the value MOON's authors found best for FedProx on CIFAR and FedSKC's code
carries; the paper tunes it over {0.001, 0.01, 0.1, 1}); ``mu = 0`` is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protofl.federation.client import PrototypeClient
from protofl.federation.wire import PROXIMAL_LOSS
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.losses import proximal_term


@dataclass(frozen=True)
class FedProxOptions(ParameterAveraging):
    mu: float = 0.01

    capturable: ClassVar[bool] = True  # a sum over the parameters: fixed shapes, no host sync

    def check(self) -> None:
        if self.mu < 0:
            raise ValueError(f"fedprox.mu must be >= 0, got {self.mu}")


class FedProxStrategy(AveragingStrategy):
    options_class = FedProxOptions
    loss_metrics = (PROXIMAL_LOSS,)


class FedProxClient(PrototypeClient):
    options_class = FedProxOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.anchors = [p.detach().clone() for p in self.trained]  # w^t

    def batch_loss(self, features, logits, labels, inputs):
        proximal = proximal_term(self.trained, self.anchors)  # Eq. 2 without mu
        self.record_loss(**{PROXIMAL_LOSS: proximal})
        return self.options.mu * proximal

    def step_constants(self):
        return ()

    def step_inputs(self):
        return {f"anchor/{i}": anchor for i, anchor in enumerate(self.anchors)}


STRATEGY, CLIENT = FedProxStrategy, FedProxClient
