"""FedDistill (FD; Jeong et al., 2018, in HtFLlib's form): clients share per-class mean logits,
and distil the federation's into their own models.

Client: its own model, kept on its node (any architecture: nothing but logits leaves it). Loss per
mini-batch CE(z, y) + lambda * CE_soft(z, t_y): t_y the global mean logit of class y received, and,
for a class without one, the sample's own logit detached (HtFLlib's); CE_soft(z, t) = -sum_j t_j
log softmax(z)_j, the mean logits through a softmax (``target = "softmax"``, a distillation target)
or taken as they are (``"logits"``, HtFLlib's). Uploads its per-class mean logits over every
training mini-batch of the round (the training-mode logits, as HtFLlib collects them) and its class
counts. HtFLlib's raw targets make the loss unbounded below: a client whose mean loss turns negative is
dropped by admission (a train loss must be >= 0), so ``"softmax"`` is the default.

Server: the global logit of a class is the unweighted mean over the clients that uploaded it
(HtFLlib's); a class no client of the round holds has none. lambda = 0.1 (FedSA's scripts).

PM: the client's own model (its head). No GM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from protofl.federation.client import PrototypeClient
from protofl.federation.wire import GLOBAL_PROTOTYPES
from protofl.settings import KeptModel, MethodOptions
from protofl.strategies.families.class_vectors import ClassVectorAveraging
from protofl.task.prototypes import PrototypeWeighting
from protofl.task.statistics import PrototypePass


@dataclass(frozen=True)
class FedDistillOptions(MethodOptions):
    statistics: ClassVar[Literal["logit"]] = "logit"
    keeps_model: ClassVar[KeptModel] = "trains"
    weighting: ClassVar[PrototypeWeighting] = "uniform"
    prototype_pass: ClassVar[PrototypePass] = "during-train"
    average_parameters: ClassVar[bool] = False
    lambda_: float = 0.1  # key "lambda"
    target: Literal["softmax", "logits"] = "softmax"

    capturable: ClassVar[bool] = True  # fixed shapes, no host sync

    def check(self) -> None:
        if self.lambda_ < 0:
            raise ValueError(f"feddistill.lambda must be >= 0, got {self.lambda_}")

    def shares(self, name: str) -> bool:
        return False


def distillation_loss(logits: torch.Tensor, labels: torch.Tensor, global_logits: torch.Tensor,
                      available: torch.Tensor, softmax_target: bool = False) -> torch.Tensor:
    """The batch mean of CE_soft(z_i, t_i): t_i the global logit of y_i where ``available``, else z_i
    itself (detached); through a softmax with ``softmax_target``."""
    has_global = available[labels].unsqueeze(1)
    targets = torch.where(has_global, global_logits[labels].to(logits.dtype), logits.detach())
    if softmax_target:
        targets = targets.softmax(dim=1)
    return -(targets * logits.log_softmax(dim=1)).sum(dim=1).mean()


class FedDistillStrategy(ClassVectorAveraging):
    options_class = FedDistillOptions
    predictor_names = ("head",)


class FedDistillClient(PrototypeClient):
    options_class = FedDistillOptions

    def receive(self, parameters, this_round):
        received = self.received_masked_vectors(this_round, GLOBAL_PROTOTYPES, self.data.num_classes)
        self.global_logits = None if received is None else (
            torch.from_numpy(received.vectors).to(self.device), torch.from_numpy(received.mask).to(self.device))

    def batch_loss(self, features, logits, labels, inputs):
        if self.global_logits is None or self.options.lambda_ <= 0:
            return None
        return self.options.lambda_ * distillation_loss(logits, labels, *self.global_logits,
                                                        self.options.target == "softmax")

    def step_constants(self):
        return self.global_logits is None

    def step_inputs(self):
        if self.global_logits is None:
            return {}
        global_logits, available = self.global_logits
        return {"global_logits": global_logits, "available_classes": available}


STRATEGY, CLIENT = FedDistillStrategy, FedDistillClient
