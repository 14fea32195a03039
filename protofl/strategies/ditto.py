"""Ditto (Li et al., ICML 2021): a global model trained as FedAvg's, and beside it on each client a
personal model kept near it.

Client, each round (Algorithm 1 of the paper): the global model w^t received trains
``local-epochs`` epochs with cross-entropy (as FedAvg's) and goes up; the personal model v_k, kept
on the client's node (before its first round: the initial model), trains as many epochs on
h_k(v) = CE(v) + (lambda / 2) ||v - w||^2 (Eq. 2), whose gradient adds lambda (v - w) to CE's.
``reference = "received"``: w = w^t, the global model received (the paper's Algorithm 1, PFLlib);
``"trained"``: w = the client's global model after this round's training (FedNH's code). Both
trainings run the run's optimiser settings (FedNH's code steps v by plain SGD). lambda: 0.75 (FedNH's
code; the paper tunes it per data set). The proximal term's batch mean is reported as ``proximal-loss``.

Server: FedAvg (``weighted = false``: unweighted). GM: the global model. PM: the personal model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.federation.wire import PROXIMAL_LOSS
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.task.losses import proximal_term
from protofl.task.weights import all_tensors

PERSONAL = "personal/"  # local_state names of the personal model's entries


@dataclass(frozen=True)
class DittoOptions(ParameterAveraging):
    lambda_: float = 0.75  # key "lambda"
    reference: Literal["received", "trained"] = "received"

    capturable: ClassVar[bool] = True  # the global model's step has no batch loss

    @property
    def keeps_client_state(self) -> bool:
        return True  # the personal model

    def check(self) -> None:
        if self.lambda_ < 0:
            raise ValueError(f"ditto.lambda must be >= 0, got {self.lambda_}")


class DittoStrategy(AveragingStrategy):
    options_class = DittoOptions
    loss_metrics = (PROXIMAL_LOSS,)


class DittoClient(PrototypeClient):
    options_class = DittoOptions

    def receive(self, parameters, this_round):
        self.personal = copy.deepcopy(self.model)  # the initial model, until the client has its own
        self.restore_personal_model(self.personal, PERSONAL)
        self.load_shared(parameters)
        self.received = {k: v.detach().clone() for k, v in all_tensors(self.model).items()}  # w^t

    def local_training(self, this_round):
        loss = self.train_model(this_round)  # the global model, as FedAvg's
        reference = self.received if self.options.reference == "received" else all_tensors(self.model)
        anchors = [reference[name].detach() for name, p in self.personal.named_parameters() if p.requires_grad]
        trained = [p for p in self.personal.parameters() if p.requires_grad]

        def personal_loss(inputs, features, logits, labels):  # Eq. 2
            proximal = proximal_term(trained, anchors)
            self.record_loss(**{PROXIMAL_LOSS: proximal})
            return F.cross_entropy(logits, labels) + self.options.lambda_ * proximal

        self.train_model(this_round, model=self.personal, loss=personal_loss)
        return loss

    def after_fit(self, statistics):
        self.store_personal_model(self.personal, PERSONAL)
        return {}

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # before the client's first round: the global model
        self.restore_personal_model(prefix=PERSONAL)  # PM: v_k


STRATEGY, CLIENT = DittoStrategy, DittoClient
