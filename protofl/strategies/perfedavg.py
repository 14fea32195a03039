"""Per-FedAvg (Fallah et al., NeurIPS 2020): a global model trained to be a good start for one
step of local adaptation (MAML), first-order form (Per-FedAvg (FO), PFLlib's).

Client, each round (Algorithm 1): the global model w trains on mini-batches of twice the run's
batch size, each split in two halves D and D' (a trailing pair short of a full one follows the
run's ``partial-batch``; one without a second half is skipped): the adapted model
w' = w - alpha grad f(w; D), then w <- w - beta grad f(w'; D') (Eq. 7 and 8 with the
first-order approximation of the meta-gradient). Plain gradient steps, as in the paper: the run's
momentum, weight decay and clipping do not apply. The training loss reported is the mean of the
two halves' cross-entropies.

Server: FedAvg (``weighted``: by training size). GM: the global model, not adapted. PM: the global
model after one step at alpha on one mini-batch of the client's training split (the paper's
evaluation; PFLlib's ``evaluate_one_step``), drawn from the scored round's seed.

``alpha`` and ``beta``: ``"auto"`` is the round's learning rate (PFLlib's: its client sets both to
the local learning rate; the table presets run so). ``alpha`` is 0.01 by default, ``beta`` the
round's learning rate: at the digits job's lr 0.05 the adaptation step on 10 samples overshoots, and
with alpha = 0.05 the training loss rose from 1.75 to 17 within 8 epochs where FedAvg's fell to 0.11
(one client of digits, one epoch a round); at 0.01 it fell to 0.41.

PFLlib's server trains every client twice per round; protofl's once, as every other method
(``local-epochs = 2`` is the same work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from protofl.federation.client import PrototypeClient
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging


@dataclass(frozen=True)
class PerFedAvgOptions(ParameterAveraging):
    alpha: float | Literal["auto"] = 0.01  # the adaptation step
    beta: float | Literal["auto"] = "auto"  # the meta step

    def check(self) -> None:
        for key in ("alpha", "beta"):
            value = getattr(self, key)
            if value != "auto" and not float(value) > 0:
                raise ValueError(f"perfedavg.{key} must be > 0 or 'auto', got {value}")

    def step_sizes(self, lr: float) -> tuple[float, float]:
        """(alpha, beta) in a round whose learning rate is ``lr``."""
        return tuple(lr if value == "auto" else float(value) for value in (self.alpha, self.beta))

    def resolved(self, settings) -> dict[str, float]:
        return {key: settings.lr for key in ("alpha", "beta") if getattr(self, key) == "auto"}


class PerFedAvgStrategy(AveragingStrategy):
    options_class = PerFedAvgOptions


def gradient_step(parameters: list[torch.Tensor], loss: torch.Tensor, step_size: float) -> None:
    """parameters <- parameters - step_size * grad loss."""
    gradients = torch.autograd.grad(loss, parameters)
    with torch.no_grad():
        torch._foreach_add_(parameters, list(gradients), alpha=-step_size)


class PerFedAvgClient(PrototypeClient):
    options_class = PerFedAvgOptions

    def local_training(self, this_round):
        alpha, beta = self.options.step_sizes(this_round.lr)
        w = [p for p in self.model.parameters() if p.requires_grad]
        half = self.settings.batch_size
        total, halves = torch.zeros((), device=self.device), 0
        for inputs, labels in self.training_batches(this_round, batch_size=2 * half):
            if len(labels) <= half:
                continue  # no D'
            start = [p.detach().clone() for p in w]
            inner = F.cross_entropy(self.model(inputs[:half])[1], labels[:half])
            gradient_step(w, inner, alpha)  # w' = w - alpha grad f(w; D)
            outer = F.cross_entropy(self.model(inputs[half:])[1], labels[half:])
            gradients = torch.autograd.grad(outer, w)  # grad f(w'; D')
            with torch.no_grad():
                torch._foreach_copy_(w, start)
                torch._foreach_add_(w, list(gradients), alpha=-beta)  # w <- w - beta grad f(w'; D')
            total += inner.detach() + outer.detach()
            halves += 2
        return float(total) / max(halves, 1)

    def prepare_evaluation(self, parameters, this_round):
        self.receive(parameters, this_round)
        this_round = self.scored_round(this_round)
        alpha, _ = self.options.step_sizes(this_round.lr)
        inputs, labels = next(iter(self.training_batches(this_round)))
        w = [p for p in self.model.parameters() if p.requires_grad]
        gradient_step(w, F.cross_entropy(self.model(inputs)[1], labels), alpha)  # one step of adaptation


STRATEGY, CLIENT = PerFedAvgStrategy, PerFedAvgClient
