"""pFedMe (Dinh et al., NeurIPS 2020): personalisation by Moreau envelopes.

Each client keeps two models: w, its local copy of the global model, which goes up, and theta, its
personalised model. Client, each round (Algorithm 1): w and theta start from the global model
received; on every mini-batch theta takes ``k`` steps towards theta(w) = argmin_theta f(theta) +
(lambda / 2) ||theta - w||^2 (Eq. 7), each theta <- theta - personal_lr (grad f(theta) +
lambda (theta - w) + mu theta); then w <- w - eta lambda (w - theta) (Eq. 8, eta the round's lr).
``mu``: 0 in the paper; the authors' code and PFLlib add mu theta (0.001) to each inner step. The
steps are plain gradient steps, as in the paper: the run's momentum, weight decay and clipping do
not apply. The training loss reported is the mean cross-entropy of the inner steps.

Server (Algorithm 1, line 9): w <- (1 - beta) w + beta * the clients' average of their w
(``weighted``: by training size, PFLlib's), beta = 1 being FedAvg's average.

PM: theta, the personalised model, after the client's last training (the paper's; PFLlib's
``test_metrics_personalized`` scores the global model received, its personalised parameters being
the model's own, overwritten by w and then by the global model). GM: the global model.
Defaults: the paper's (lambda 15, K 5, personal lr 0.01, beta 1).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.settings import KeptModel
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging


@dataclass(frozen=True)
class PFedMeOptions(ParameterAveraging):
    lambda_: float = 15.0  # key "lambda"
    k: int = 5  # inner steps per mini-batch
    personal_lr: float = 0.01
    mu: float = 0.0
    beta: float = 1.0

    keeps_model: ClassVar[KeptModel] = "scores"  # theta

    def check(self) -> None:
        if self.lambda_ < 0 or self.mu < 0:
            raise ValueError(f"pfedme.lambda and pfedme.mu must be >= 0, got {self.lambda_} and {self.mu}")
        if self.k < 1:
            raise ValueError(f"pfedme.k must be >= 1, got {self.k}")
        if not self.personal_lr > 0 or not self.beta > 0:
            raise ValueError(f"pfedme.personal-lr and pfedme.beta must be > 0, got {self.personal_lr} and {self.beta}")


class PFedMeStrategy(AveragingStrategy):
    options_class = PFedMeOptions

    def aggregate_updates(self, server_round, updates):
        mean = super().aggregate_updates(server_round, updates)
        beta = self.options.beta
        return self.stepped_entries(self.admission.sent_parameters, mean,
                                    lambda i, w, m: (1.0 - beta) * w + beta * m)  # line 9


class PFedMeClient(PrototypeClient):
    options_class = PFedMeOptions

    def exchanged_model(self):
        return copy.deepcopy(self.model)  # w; the client's own model is theta

    def receive(self, parameters, this_round):
        self.load_shared(parameters)  # w
        self.model.load_state_dict(self.exchanged.state_dict())  # theta starts from it

    def local_training(self, this_round):
        o = self.options
        lr = this_round.lr
        theta = [p for p in self.model.parameters() if p.requires_grad]
        w = [p for p in self.exchanged.parameters() if p.requires_grad]
        total, steps = torch.zeros((), device=self.device), 0
        for inputs, labels in self.training_batches(this_round):
            for _ in range(o.k):  # Eq. 7, approximately
                loss = F.cross_entropy(self.model(inputs)[1], labels)
                gradients = torch.autograd.grad(loss, theta)
                with torch.no_grad():
                    for t, g, local in zip(theta, gradients, w):
                        t.sub_(o.personal_lr * (g + o.lambda_ * (t - local) + o.mu * t))
                total += loss.detach()
                steps += 1
            with torch.no_grad():  # Eq. 8
                for local, t in zip(w, theta):
                    local.sub_(lr * o.lambda_ * (local - t))
        return float(total) / max(steps, 1)

    def after_fit(self, statistics):
        with torch.no_grad():  # theta's BatchNorm statistics go up with w
            for (_, up), (_, own) in zip(self.exchanged.named_buffers(), self.model.named_buffers()):
                up.copy_(own)
        return {}


STRATEGY, CLIENT = PFedMeStrategy, PFedMeClient
