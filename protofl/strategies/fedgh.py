"""FedGH (Yi et al., ACM MM 2023): a generalised global head trained on the server on the clients'
prototypes.

Client: trains its whole model (its own body, kept on its node, under the global head received) with
cross-entropy, then uploads its class prototypes (per-class mean features of an eval pass over its
training split) and class counts (Eq. 4). Its body never leaves the node: every client may run its own
architecture (a model family).

Server: the global head, from the head it sent this round, takes ``server-epochs`` epochs of plain SGD
at ``server-lr`` with cross-entropy on the uploaded (prototype, class) pairs (Eq. 5), in mini-batches
of ``batch-size`` drawn in a seeded order (the last one smaller); it goes out as the shared entries.
Defaults: HtFLlib's scripts (1 epoch, lr 0.01).

PM: the client's own body with the global head. No GM.

HtFLlib's code (e959261) collects the uploaded prototypes from the trained model, as here, but over
the full batches only (its loader drops the last partial batch, and does not shuffle): protofl's cover
the whole training split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.strategies.families.model_parts import HEAD, HeadSharing
from protofl.task.prototypes import prototype_pairs
from protofl.task.server_training import minibatch_sgd, shuffles


@dataclass(frozen=True)
class FedGHOptions(HeadSharing):
    server_epochs: int = 1
    server_lr: float = 0.01

    capturable: ClassVar[bool] = True  # no batch loss

    def check(self) -> None:
        if self.server_epochs < 0:
            raise ValueError(f"fedgh.server-epochs must be >= 0, got {self.server_epochs}")
        if not self.server_lr > 0:
            raise ValueError(f"fedgh.server-lr must be > 0, got {self.server_lr}")


def train_head(head: torch.nn.Module, weights: dict[str, torch.Tensor], prototypes: torch.Tensor,
               labels: torch.Tensor, epochs: int, lr: float, batch_size: int, orders) -> dict[str, torch.Tensor]:
    """Eq. 5: ``head`` with parameters ``weights`` (by name) trained on the pairs with cross-entropy,
    :func:`~protofl.task.server_training.minibatch_sgd`; returns the trained weights."""
    trained = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}

    def loss(batch):
        return F.cross_entropy(functional_call(head, trained, (prototypes[batch],)), labels[batch])

    minibatch_sgd(list(trained.values()), loss, len(labels), epochs, batch_size, lr, orders)
    return {k: v.detach() for k, v in trained.items()}


class FedGHStrategy(ServerRule):
    options_class = FedGHOptions

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        names = [n for n in self.model.state_dict() if self.options.shares(n)]
        sent = self.admission.sent_parameters
        weights = {n.removeprefix(HEAD): torch.from_numpy(np.array(a)).to(self.device) for n, a in zip(names, sent)}
        means, counts = stacked_statistics(updates)
        prototypes, labels = prototype_pairs(means, counts)
        dtype = next(iter(weights.values())).dtype
        trained = train_head(self.model.head, weights, torch.from_numpy(prototypes).to(self.device, dtype),
                             torch.from_numpy(labels).to(self.device), self.options.server_epochs,
                             self.options.server_lr, self.settings.batch_size,
                             shuffles(len(labels), self.server_generator(server_round)))
        return [trained[n.removeprefix(HEAD)].cpu().numpy().astype(a.dtype) for n, a in zip(names, sent)]


class FedGHClient(PrototypeClient):
    options_class = FedGHOptions


STRATEGY, CLIENT = FedGHStrategy, FedGHClient
