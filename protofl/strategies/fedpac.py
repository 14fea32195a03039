"""FedPAC (Xu et al., ICLR 2023): feature alignment to global prototypes and a classifier
combined per client from its peers' heads.

Client, each round (Algorithm 1; PFLlib's ``clientpac``): with the global body received under its
own head (kept on its node), it first measures, over its training split, the feature statistics of
the received body: h_i[k] = p_ik mu_ik (p_ik its share of class k, mu_ik the class's mean feature)
and V_i = (sum_k p_ik tr(F_ik^T F_ik) / n_ik - p_ik^2 ||mu_ik||^2) / n_i, the division by the
training size n_i being the code's (PFLlib's and the authors'). It trains the head one epoch with
the body frozen (Eq. 7), then the body ``local-epochs`` with the head frozen on
CE + lambda ||f(x) - c_y||^2 / d (Eq. 5: the mean squared distance to the global prototype of the
sample's class; zero for a class without one, FedProto's ``prototype_loss``). It uploads the body,
its per-class mean features (the class statistics), its head (``head/<i>``) and V_i and h_i
(``feature-variance``, ``class-centroids``).

Server: the body by FedAvg (``weighted``: by training size); the global prototypes the unweighted
mean over the clients holding each class (Eq. 6); for each client i of the round, its head becomes
sum_j a_ij head_j, a_i the minimiser of a^T (diag(V) + D_i) a over the simplex,
D_i[j, k] = sum_c (h_i[c] - h_j[c]) . (h_i[c] - h_k[c]) (Eq. 10-11), solved exactly
(:func:`~protofl.task.quadratic.simplex_minimum`, no solver dependency; PFLlib calls cvxpy), and
weights below 1e-3 zeroed (the code's; not renormalised). V_j is not screened by magnitude: honest
ones span orders of magnitude, and a larger one only lowers client j's own weight, a_j^2 V_j being at
most the objective at the client's own head, V_i (a 1e30 one gets 0; the solver is scale-free).
Each client receives its combined head with the next message, with the round it was made in: a
client whose last training is not that round's (its update was dropped since) keeps its own head.
PM: the client's head on the global body. GM: the global body with the initial head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.wire import GLOBAL_PROTOTYPES, ArraySpec, ClassVectors, indexed
from protofl.strategies.families.model_parts import HEAD, BodyAveraging, BodySharing
from protofl.task.losses import prototype_loss
from protofl.task.models import trainable_only
from protofl.task.prototypes import aggregate_prototypes
from protofl.task.quadratic import simplex_minimum

HEAD_UPLOAD, VARIANCE, CENTROIDS = "head", "feature-variance", "class-centroids"
COMBINED_HEAD, COMBINED_ROUND = "combined-head", "combined-head-round"
LAST_FIT = "last-fit-round"  # local_state: the round of the client's last training
SMALL_WEIGHT = 1e-3  # combination weights at or below it are zeroed (the code's eps)


@dataclass(frozen=True)
class FedPACOptions(BodySharing):
    lambda_: float = 1.0  # key "lambda"

    statistics: ClassVar[Literal["feature"]] = "feature"
    capturable: ClassVar[bool] = True  # prototype_loss: fixed shapes, no host sync

    def check(self) -> None:
        if self.lambda_ < 0:
            raise ValueError(f"fedpac.lambda must be >= 0, got {self.lambda_}")


def feature_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[float, np.ndarray]:
    """(V_i, h_i) of one client's features (n x d) and labels, in float64."""
    f = features.detach().to("cpu", torch.float64)
    y = labels.cpu()
    n = len(y)
    counts = torch.bincount(y, minlength=num_classes).to(torch.float64)
    sums = torch.zeros(num_classes, f.shape[1], dtype=torch.float64).index_add_(0, y, f)
    squares = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y, (f * f).sum(1))
    held = counts > 0
    means = torch.where(held[:, None], sums / counts.clamp(min=1)[:, None], 0.0)
    share = counts / n
    variance = (share * squares / counts.clamp(min=1) - share**2 * (means**2).sum(1))[held].sum() / n
    return float(variance), (share[:, None] * means).numpy()


def combination_matrix(own: int, variances: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """diag(V) + D_own (Eq. 11) from the round's V (K) and h (K x C x d)."""
    differences = (centroids[own][None] - centroids).reshape(len(centroids), -1).astype(np.float64)
    return np.diag(variances.astype(np.float64)) + differences @ differences.T


def combination_weights(matrix: np.ndarray) -> np.ndarray:
    """The head weights a_i: the simplex minimiser, small weights zeroed."""
    weights = simplex_minimum(matrix)
    return np.where(weights > SMALL_WEIGHT, weights, 0.0)


class FedPACStrategy(BodyAveraging):
    options_class = FedPACOptions
    state_fields = ("global_prototypes", "combined_heads")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_initial = [p.detach().cpu().numpy().copy() for name, p in self.model.named_parameters()
                             if name.startswith(HEAD) and p.requires_grad]
        self.global_prototypes: ClassVectors | None = None
        self.combined_heads: dict[int, tuple[int, list[np.ndarray]]] = {}  # partition -> (round made, head)

    def upload_specs(self) -> dict[str, ArraySpec]:
        dtype = self.head_initial[0].dtype
        return ({name: ArraySpec.like(a) for name, a in indexed(HEAD_UPLOAD, self.head_initial).items()}
                # honest V_i span orders of magnitude (one class or ten); a larger one only lowers
                # its client's own weight in the others' heads
                | {VARIANCE: ArraySpec((1,), (str(dtype),), nonnegative=True, scale="bounded"),
                   CENTROIDS: ArraySpec((self.num_classes, self.model.feature_dim), (str(dtype),))})

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.global_prototypes.to_config(GLOBAL_PROTOTYPES) if self.global_prototypes else {}

    def broadcast_to(self, server_round: int, partition_id: int) -> dict[str, np.ndarray]:
        if partition_id not in self.combined_heads:
            return {}
        made, head = self.combined_heads[partition_id]
        return indexed(COMBINED_HEAD, head) | {COMBINED_ROUND: np.array([made], np.int64)}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        prototypes, mask = aggregate_prototypes(*stacked_statistics(updates), "uniform", **self.prototype_rule)
        self.global_prototypes = ClassVectors(prototypes, mask)  # Eq. 6
        names = list(indexed(HEAD_UPLOAD, self.head_initial))
        heads = [[u.uploads[k].astype(np.float64) for k in names] for u in updates]
        variances = np.array([u.uploads[VARIANCE][0] for u in updates], np.float64)
        centroids = np.stack([u.uploads[CENTROIDS] for u in updates])
        for i, update in enumerate(updates):  # Eq. 10-11
            weights = combination_weights(combination_matrix(i, variances, centroids))
            combined = [sum(w * head[t] for w, head in zip(weights, heads)) for t in range(len(names))]
            head = [c.astype(a.dtype) for c, a in zip(combined, self.head_initial)]
            self.combined_heads = self.combined_heads | {update.partition_id: (server_round, head)}
        return super().aggregate_updates(server_round, updates)


class FedPACClient(PrototypeClient):
    options_class = FedPACOptions

    def receive(self, parameters, this_round):
        self.prepare_evaluation(parameters, this_round)
        features, _ = self.forward(self.data.train_x)  # the received body's
        self.variance, self.centroids = feature_statistics(features, self.data.train_y, self.data.num_classes)
        self.received_prototypes = self.global_prototypes(this_round)
        self.head_phase = False
        self.fit_round = this_round.number

    def prepare_evaluation(self, parameters, this_round):
        self.load_shared(parameters)  # the global body under the client's head
        head = self.head_parameters()
        combined = self.received_like(this_round, COMBINED_HEAD, head)
        made = self.received(this_round, COMBINED_ROUND, ArraySpec((1,), ("int64",)))
        last = self.local_state.get(LAST_FIT)
        if combined is not None and made is not None and last is not None and int(made[0]) == int(last[0]):
            with torch.no_grad():
                torch._foreach_copy_(head, combined)

    def head_parameters(self) -> list[torch.nn.Parameter]:
        return [p for name, p in self.model.named_parameters() if name.startswith(HEAD) and p.requires_grad]

    def local_training(self, this_round):
        head = self.head_parameters()
        body = [p for name, p in self.model.named_parameters() if not name.startswith(HEAD)]
        self.head_phase = True
        with trainable_only(self.model, head):  # Eq. 7: one epoch, the body frozen
            self.train_model(this_round, epochs=1, phase="head")
        self.head_phase = False
        with trainable_only(self.model, body):  # Eq. 5: the body, the head frozen
            return self.train_model(this_round, phase="body")

    def batch_loss(self, features, logits, labels, inputs):
        if self.head_phase or self.received_prototypes is None or self.options.lambda_ <= 0:
            return None
        return self.options.lambda_ * prototype_loss(features, labels, *self.received_prototypes)

    def step_constants(self):
        return (self.head_phase, self.received_prototypes is None)

    def step_inputs(self):
        if self.received_prototypes is None:
            return {}
        prototypes, available = self.received_prototypes
        return {"received_prototypes": prototypes, "available_classes": available}

    def after_fit(self, statistics):
        self.local_state[LAST_FIT] = np.array([self.fit_round], np.int64)
        return {}

    def uploads(self):
        head = [p.detach().cpu().numpy() for p in self.head_parameters()]
        dtype = head[0].dtype
        return (indexed(HEAD_UPLOAD, head)
                | {VARIANCE: np.array([self.variance], dtype), CENTROIDS: self.centroids.astype(dtype)})


STRATEGY, CLIENT = FedPACStrategy, FedPACClient
