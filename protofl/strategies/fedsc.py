"""FedSC (Wang et al., KDD 2025): semantic-aware collaboration through relational and consistent
prototypes. Equation numbers are the paper's; defaults follow the paper, the released code's
behaviour is a switch where it differs (spec ``fedsc_fedskc.md`` §2.9).

Client: round 1 (no server prototypes yet) trains with CE only; later rounds with
CE + RPCL + CPDR per mini-batch:
- RPCL (Eq. 13-14): multi-positive InfoNCE of each feature against every relational prototype of
  its class (positives) and all other classes' (negatives), temperature 0.05, similarity
  cos(z, r) / U(r) with U(r) the batch's mean distance to r (``similarity-norm = "none"``: plain
  cosine, as the code);
- CPDR (Eq. 15): distance of each feature to its class's consistent prototype, MSE as the code
  (``cpdr-distance = "l1"``: Eq. 15 as printed; ``"l2"``: the appendix's norm).
Samples of a class the server has no prototype for are left out of both. After training the
per-class mean features of an eval pass over the training split (``prototype-pass = "post-eval"``;
``"last-epoch"``: of the last epoch's training features, as the code) and the class counts go
up next to the parameters.

Server: FedAvg of the parameters (weighted by training sizes). Per class, among the clients that
hold it: each client's prototype merged with its M = 2 neighbours by the angle to the class's mean
prototype (Eq. 5, 7-9; ``neighbour-metric`` l1 / l2 / cosine / kl: pairwise, Table 5), giving the
relational prototypes; the label-distribution discrepancy d_k (Eq. 10) and sigmoid weights
e_k (Eq. 11); the consistent prototype o^j = sum e_k r_k^j / sum e_k over the holders of j
(Eq. 12). Both go out as bytes in the next round's fit config. Ablations (Table 4): ``use-rpcl``,
``use-cpdr``; ``neighbours = 0`` keeps the raw prototypes (what the code's merge amounts to).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protofl.config import ExperimentConfig
from protofl.strategies.base import (
    ArraySpec,
    ClientUpdate,
    PrototypeClient,
    PrototypeStrategy,
    aggregate_prototypes,
    average_parameters,
    check_class_counts,
    check_loss_metrics,
    get_weights,
    mean_client_metrics,
    set_weights,
)
from protofl.task.prototypes import (
    NEIGHBOUR_METRICS,
    SIMILARITY_NORMS,
    neighbour_merge,
    prototype_infonce,
    sigmoid_discrepancy_weights,
)
from protofl.task.train import train

CPDR_DISTANCES = ("mse", "l1", "l2")
LOSS_KEYS = ("rpcl-loss", "cpdr-loss")


@dataclass(frozen=True)
class FedSCOptions:
    use_rpcl: bool = True
    use_cpdr: bool = True
    lambda_rpcl: float = 1.0
    lambda_cpdr: float = 1.0
    temperature: float = 0.05
    similarity_norm: str = "mean-distance"
    cpdr_distance: str = "mse"
    neighbours: int = 2  # M
    neighbour_metric: str = "angle"
    prototype_pass: str = "post-eval"

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> "FedSCOptions":
        options = config.options_as(cls, {
            "similarity_norm": SIMILARITY_NORMS, "cpdr_distance": CPDR_DISTANCES,
            "neighbour_metric": NEIGHBOUR_METRICS, "prototype_pass": ("post-eval", "last-epoch"),
        })
        if options.temperature <= 0 or options.neighbours < 0 or min(options.lambda_rpcl, options.lambda_cpdr) < 0:
            raise ValueError("fedsc: temperature must be > 0, neighbours and the loss weights >= 0")
        return options


# --- server math ------------------------------------------------------------------------


def relational_prototypes(prototypes: np.ndarray, held: np.ndarray, neighbours: int, metric: str) -> np.ndarray:
    """K x C x d client prototypes -> K x C x d relational prototypes (Eq. 7-9): per class, each
    holder's prototype merged with its ``neighbours`` nearest holders; zero where not held."""
    relational = np.zeros(prototypes.shape, dtype=np.float32)
    for c in range(prototypes.shape[1]):
        holders = np.flatnonzero(held[:, c])
        if len(holders):
            relational[holders, c] = neighbour_merge(prototypes[holders, c], neighbours, metric)
    return relational


def label_discrepancy(class_counts: np.ndarray) -> np.ndarray:
    """d_k = sqrt(1/2 sum_j (n_k^j / n_k - 1 / C)^2): distance of each client's label distribution
    to uniform (Eq. 10)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    shares = counts / counts.sum(axis=1, keepdims=True)
    return np.sqrt(0.5 * ((shares - 1.0 / counts.shape[1]) ** 2).sum(axis=1))


def consistent_prototypes(
    relational: np.ndarray, held: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """o^j = sum_k e_k r_k^j / sum_k e_k over the clients holding j (Eq. 12, renormalised);
    (C x d, C mask of classes someone holds)."""
    return aggregate_prototypes(relational, held * np.asarray(weights, dtype=np.float64)[:, None], "count")


# --- client math ------------------------------------------------------------------------


def consistency_loss(
    features: torch.Tensor, labels: torch.Tensor, consistent: torch.Tensor, mask: torch.Tensor, distance: str
) -> torch.Tensor:
    """CPDR (Eq. 15): distance of each feature to its class's consistent prototype; ``mse``
    averages the squared differences over samples x d, ``l1`` / ``l2`` average the per-sample
    norms. Samples of classes without a consistent prototype are left out."""
    keep = mask[labels]
    if not bool(keep.any()):
        return features.new_zeros(())
    difference = features[keep] - consistent[labels[keep]].to(features.dtype)
    if distance == "mse":
        return (difference**2).mean()
    return difference.abs().sum(dim=1).mean() if distance == "l1" else difference.norm(dim=1).mean()


# --- server -----------------------------------------------------------------------------


class FedSCStrategy(PrototypeStrategy):
    broadcast_to_evaluate = False  # evaluation scores the global model's head

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedSCOptions.from_config(self.config)
        self.knowledge: dict[str, np.ndarray] = {}

    def upload_spec(self) -> dict[str, ArraySpec]:
        return self.class_statistics_spec("prototypes")

    def check_update(self, update: ClientUpdate) -> None:
        check_class_counts(update)
        check_loss_metrics(update, LOSS_KEYS)

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.knowledge

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        prototypes = np.stack([u.payload["prototypes"] for u in updates])
        counts = np.stack([u.payload["class-counts"] for u in updates])
        held = counts > 0
        relational = relational_prototypes(prototypes, held, self.options.neighbours, self.options.neighbour_metric)
        discrepancies = label_discrepancy(counts)
        weights = sigmoid_discrepancy_weights(counts.sum(axis=1), discrepancies)  # Eq. 11
        consistent, mask = consistent_prototypes(relational, held, weights)
        self.knowledge = {
            "relational-prototypes": relational[held],
            "relational-labels": np.nonzero(held)[1].astype(np.int64),
            "consistent-prototypes": consistent,
            "consistent-mask": mask,
        }
        self.recorder.update(
            server_round,
            relational_prototypes=int(held.sum()),
            consistent_weight_min=float(weights.min()),
            consistent_weight_max=float(weights.max()),
            **mean_client_metrics(updates, LOSS_KEYS),
        )
        return average_parameters(updates)


# --- client -----------------------------------------------------------------------------


class FedSCClient(PrototypeClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedSCOptions.from_config(self.config)

    def _server_prototypes(self, config) -> tuple[torch.Tensor, ...] | None:
        """(relational prototypes, their labels, consistent prototypes, their mask); None before
        the server has any (round 1)."""
        num_classes = self.data.num_classes
        relational = self.received(config, "relational-prototypes", ArraySpec((None, self.model.feature_dim)))
        labels = self.received(config, "relational-labels", ArraySpec((None,), ("int64",), nonnegative=True))
        consistent = self.received_class_vectors(config, "consistent-prototypes")
        mask = self.received(config, "consistent-mask", ArraySpec((num_classes,), ("bool",)))
        if relational is None or labels is None or consistent is None or mask is None:
            return None
        if len(labels) != len(relational) or (labels >= num_classes).any():
            raise ValueError("FedSC: the relational labels do not match the relational prototypes")
        return tuple(torch.from_numpy(a).to(self.device) for a in (relational, labels, consistent, mask))

    def fit(self, parameters, config):
        set_weights(self.model, parameters)
        received = self._server_prototypes(config)
        seen = self.prototype_collector(self.options.prototype_pass)
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in LOSS_KEYS}
        options = self.options

        def semantic_losses(features, _logits, labels):
            if seen is not None:
                seen.add(features, labels)
            total = features.new_zeros(())
            if received is None:
                return total  # round 1: CE only
            relational, relational_labels, consistent, mask = received
            if options.use_rpcl:
                rpcl = prototype_infonce(  # Eq. 14
                    features, labels, relational, relational_labels, options.temperature, options.similarity_norm
                )
                parts["rpcl-loss"].append(rpcl.detach())
                total = total + options.lambda_rpcl * rpcl
            if options.use_cpdr:
                cpdr = consistency_loss(features, labels, consistent, mask, options.cpdr_distance)  # Eq. 15
                parts["cpdr-loss"].append(cpdr.detach())
                total = total + options.lambda_cpdr * cpdr
            return total

        uses_hook = seen is not None or (received is not None and (options.use_rpcl or options.use_cpdr))
        loss = train(
            self.model, self.data.train_x, self.data.train_y,
            extra_loss=semantic_losses if uses_hook else None, **self.train_kwargs(config),
        )
        prototypes = self.local_prototypes(seen)
        metrics = {key: float(torch.stack(values).mean()) for key, values in parts.items() if values}
        fit_metrics = self.fit_metrics(loss, prototypes=prototypes, **{"class-counts": self.data.class_counts()})
        return get_weights(self.model), self.data.num_train, fit_metrics | metrics

    def evaluate(self, parameters, config):
        set_weights(self.model, parameters)
        return self.evaluate_head()


STRATEGY, CLIENT = FedSCStrategy, FedSCClient
