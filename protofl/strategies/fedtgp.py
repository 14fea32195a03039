"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive-margin contrastive
loss, trained on the server.

Client: FedProto's (HtFLlib's FedTGP client): its own model, kept on its node (any architecture),
loss CE + lambda * MSE(feature, global prototype of its label) averaged over B x d (lambda = 10);
after training, per-class mean features of an eval pass over its training split, and its class
counts, go up. PM: the nearest global prototype (``inference = "prototype"``) or the head.

Server, each round: P_c, the unweighted mean of the uploaded prototypes of class c; the gap of c,
its distance to the nearest other P (a class with none: the smallest gap); the margin
delta = min(the largest gap, ``margin-threshold``) (Eq. 8). The trainable prototypes
G_c = W_2 ReLU(W_1 E_c + b_1) + b_2 (an embedding of the C classes through two Linear layers of the
feature size, kept across rounds, drawn once from the run seed) take ``server-epochs`` epochs of plain
SGD at ``server-lr`` over the uploaded (prototype, class) pairs in mini-batches of ``batch-size``
(seeded orders, the last batch smaller), on CE over -(||p - G_j|| + delta [j = y]) (Eq. 7). Every
class's G_c then goes out as the global prototypes. Defaults: FedSA's scripts (lambda 10, 100
epochs, threshold 100, lr 0.01).

HtFLlib's code (e959261) differs in three places: its client collects the prototypes it uploads from
the model the round started with (it reads the saved model before saving the trained one;
``prototype-model = "round-start"`` here, an eval pass before training), and over the full batches
only; its server trains at the clients' learning rate (``server-lr`` here, equal in FedSA's
scripts). protofl's default uploads the trained model's prototypes (the paper's Algorithm 1) of the
whole training split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import GLOBAL_PROTOTYPES, ClassStatistics, ClassVectors
from protofl.settings import KeptModel, MethodOptions
from protofl.strategies.families.class_vectors import PrototypeLossClient
from protofl.task.prototypes import aggregate_prototypes, prototype_pairs
from protofl.task.server_training import minibatch_sgd, shuffles


@dataclass(frozen=True)
class FedTGPOptions(MethodOptions):
    keeps_model: ClassVar[KeptModel] = "trains"
    prototype_classes: ClassVar[Literal["all"]] = "all"
    lambda_: float = 10.0  # key "lambda"
    server_epochs: int = 100
    server_lr: float = 0.01
    margin_threshold: float = 100.0
    inference: Literal["prototype", "head"] = "prototype"
    prototype_model: Literal["trained", "round-start"] = "trained"

    capturable: ClassVar[bool] = True  # FedProto's loss

    def check(self) -> None:
        if self.lambda_ < 0:
            raise ValueError(f"fedtgp.lambda must be >= 0, got {self.lambda_}")
        if self.server_epochs < 0:
            raise ValueError(f"fedtgp.server-epochs must be >= 0, got {self.server_epochs}")
        for key in ("server_lr", "margin_threshold"):
            if not getattr(self, key) > 0:
                raise ValueError(f"fedtgp.{key.replace('_', '-')} must be > 0, got {getattr(self, key)}")

    def shares(self, name: str) -> bool:
        return False


class TrainablePrototypes(nn.Module):
    """G: class -> an embedding through Linear-ReLU-Linear, all of the feature size."""

    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.middle = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())
        self.out = nn.Linear(dim, dim)

    def forward(self, classes: torch.Tensor) -> torch.Tensor:
        return self.out(self.middle(self.embedding(classes)))


def adaptive_margin(class_means: np.ndarray, mask: np.ndarray, threshold: float) -> float:
    """delta (Eq. 8): min(the largest class gap, ``threshold``); a gap is a class mean's distance to
    the nearest other one, the smallest gap for a class without one; ``threshold`` with fewer than
    two classes."""
    means = class_means[mask].astype(np.float64)
    if len(means) < 2:
        return float(threshold)
    distances = np.linalg.norm(means[:, None] - means[None], axis=-1)
    np.fill_diagonal(distances, np.inf)
    return float(min(distances.min(axis=1).max(), threshold))  # a class without a mean has the smallest gap


def margin_loss(prototypes: torch.Tensor, labels: torch.Tensor, centres: torch.Tensor, margin: float) -> torch.Tensor:
    """Eq. 7: CE over -(||p - G_j|| + margin [j = y]), the distances as HtFLlib expands them."""
    squared = (prototypes ** 2).sum(1, keepdim=True) - 2 * prototypes @ centres.T + (centres ** 2).sum(1)
    distances = squared.clamp_min(0).sqrt() + margin * F.one_hot(labels, len(centres)).to(prototypes.dtype)
    return F.cross_entropy(-distances, labels)


def train_prototypes(module: TrainablePrototypes, prototypes: torch.Tensor, labels: torch.Tensor, margin: float,
                     epochs: int, lr: float, batch_size: int, orders) -> None:
    """Eq. 7 over the pairs, :func:`~protofl.task.server_training.minibatch_sgd`, ``module`` in place."""
    classes = torch.arange(module.embedding.num_embeddings, device=prototypes.device)

    def loss(batch):
        return margin_loss(prototypes[batch], labels[batch], module(classes), margin)

    minibatch_sgd(list(module.parameters()), loss, len(labels), epochs, batch_size, lr, orders)


class FedTGPStrategy(ServerRule):
    options_class = FedTGPOptions
    state_fields = ("prototype_model", "global_prototypes")
    predictor_names = ("head", "prototype")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dtype = next(self.model.parameters()).dtype
        with self.seeded(0):
            self.prototype_model = TrainablePrototypes(self.num_classes, self.feature_dim).to(self.device, dtype)
        self.global_prototypes: ClassVectors | None = None

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.global_prototypes.to_config(GLOBAL_PROTOTYPES) if self.global_prototypes else {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        means, counts = stacked_statistics(updates)
        class_means, mask = aggregate_prototypes(means, counts, "uniform", **self.prototype_rule)
        o = self.options
        margin = adaptive_margin(class_means, mask, o.margin_threshold)
        prototypes, labels = prototype_pairs(means, counts)
        dtype = next(self.prototype_model.parameters()).dtype
        train_prototypes(self.prototype_model, torch.from_numpy(prototypes).to(self.device, dtype),
                         torch.from_numpy(labels).to(self.device), margin, o.server_epochs, o.server_lr,
                         self.settings.batch_size, shuffles(len(labels), self.server_generator(server_round)))
        with torch.no_grad():
            classes = torch.arange(self.num_classes, device=self.device)
            trained = self.prototype_model.eval()(classes).cpu().numpy().astype(np.float32)
        self.global_prototypes = ClassVectors(trained, np.ones(self.num_classes, bool))
        return None


class FedTGPClient(PrototypeLossClient):
    options_class = FedTGPOptions

    def local_training(self, this_round):
        # HtFLlib's form: the uploaded prototypes are of the model the round started from
        self.round_start_prototypes = self.local_prototypes() if self.options.prototype_model == "round-start" else None
        return super().local_training(this_round)

    def local_statistics(self, seen):
        if self.round_start_prototypes is None:
            return super().local_statistics(seen)
        return ClassStatistics(self.round_start_prototypes, self.data.class_counts())


STRATEGY, CLIENT = FedTGPStrategy, FedTGPClient
