"""FedSC (Wang et al., KDD 2025): semantic-aware collaboration through relational and consistent
prototypes. Equation numbers are the paper's; defaults follow the paper, the released code's
behaviour is a switch where it differs (spec ``fedsc_fedskc.md`` §2.9).

Client: round 1 (no server prototypes yet) trains with CE only; later rounds with
CE + RPCL + CPDR per mini-batch:
- RPCL (Eq. 13-14): multi-positive InfoNCE of each feature against every relational prototype of
  its class (positives) and all other classes' (negatives), temperature 0.05, similarity
  cos(z, r) / U(r) with U(r) the batch's mean distance to r (``similarity-norm = "none"``: plain
  cosine, as the code); ``rpcl-form = "code"``: what the released code computes, plain cosine, each
  sample's own feature its positive and every other-class prototype of the batch's samples pooled
  as negatives;
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
The released code as it runs: ``rpcl-form = "code"``, ``use-cpdr = false`` (its CPDR is MSE(z, z.detach()): zero, with zero gradient), ``neighbours = 0``,
``prototype-pass = "last-epoch"``; tests/test_conformance_fedsc.py checks it against numbers the
authors' code computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import ArraySpec, ClassVectors
from protofl.settings import MethodOptions
from protofl.task.prototypes import (
    NeighbourMetric,
    SimilarityNorm,
    aggregate_prototypes,
    multi_positive_infonce,
    neighbour_merge,
    sigmoid_discrepancy_weights,
)
from protofl.task.statistics import PostOrLastEpochPass

# broadcast in the fit config only
RELATIONAL_PROTOTYPES = "relational-prototypes"  # one row per (client, class held)
RELATIONAL_LABELS = "relational-labels"  # the class of each row
CONSISTENT_PROTOTYPES = "consistent-prototypes"  # ClassVectors
LOSS_KEYS = ("rpcl-loss", "cpdr-loss")


@dataclass(frozen=True)
class FedSCOptions(MethodOptions):
    use_rpcl: bool = True
    use_cpdr: bool = True
    lambda_rpcl: float = 1.0
    lambda_cpdr: float = 1.0
    temperature: float = 0.05
    similarity_norm: SimilarityNorm = "mean-distance"
    cpdr_distance: Literal["mse", "l1", "l2"] = "mse"
    neighbours: int = 2  # M
    neighbour_metric: NeighbourMetric = "angle"
    prototype_pass: PostOrLastEpochPass = "post-eval"
    rpcl_form: Literal["paper", "code"] = "paper"

    def check(self) -> None:
        if self.temperature <= 0 or self.neighbours < 0 or min(self.lambda_rpcl, self.lambda_cpdr) < 0:
            raise ValueError("fedsc: temperature must be > 0, neighbours and the loss weights >= 0")


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
    relational: np.ndarray, held: np.ndarray, weights: np.ndarray, **rule
) -> tuple[np.ndarray, np.ndarray]:
    """o^j = sum_k e_k r_k^j / sum_k e_k over the clients holding j (Eq. 12, renormalised);
    (C x d, C mask of classes someone holds). ``rule``: :func:`aggregate_prototypes`' robust rule."""
    return aggregate_prototypes(relational, held * np.asarray(weights, dtype=np.float64)[:, None], "count", **rule)


# --- client math ------------------------------------------------------------------------


def rpcl_loss(
    features: torch.Tensor, labels: torch.Tensor, relational: torch.Tensor, relational_labels: torch.Tensor,
    temperature: float, similarity_norm: str = "mean-distance", form: str = "paper",
) -> torch.Tensor:
    """RPCL (Eq. 13-14), the mean over the batch. ``paper``: :func:`multi_positive_infonce`, every
    relational prototype of the sample's class a positive, the others negatives, ``similarity_norm``
    its U.

    ``code``: what the released code computes, plain cosine whatever ``similarity_norm``: its positive lookup fails (a mean over a
    Python list) and falls back to the sample's own detached feature (similarity 1), and the
    negatives of all samples are pooled, so every sample sees each prototype once for each sample
    of the batch whose class is not the prototype's (its own class's prototypes too):
    -log(e^(1/tau) / (e^(1/tau) + sum_k m_k e^(cos(z, r_k)/tau))), m_k = #{j: y_j != class of r_k}.
    """
    if form == "paper":
        return multi_positive_infonce(features, labels, relational, relational_labels, temperature, similarity_norm)
    if form != "code":
        raise ValueError(f"rpcl form must be paper or code, got {form!r}")
    similarity = F.normalize(features, dim=1) @ F.normalize(relational.to(features.dtype), dim=1).T / temperature
    multiplicity = (labels[:, None] != relational_labels[None, :]).sum(dim=0).to(features.dtype)
    own = torch.full_like(similarity[:, :1], 1.0 / temperature)
    keys = similarity + multiplicity.log()  # log 0 = -inf: a prototype no sample's negatives hold
    return (torch.logsumexp(torch.cat([own, keys], dim=1), dim=1) - own[:, 0]).mean()


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


class FedSCStrategy(ServerRule):
    options_class = FedSCOptions
    loss_metrics = LOSS_KEYS
    state_fields = ("knowledge",)
    broadcast_to_evaluate = False  # evaluation scores the global model's head

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.knowledge: dict[str, np.ndarray] = {}

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.knowledge

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        prototypes, counts = stacked_statistics(updates)
        held = counts > 0
        relational = relational_prototypes(prototypes, held, self.options.neighbours, self.options.neighbour_metric)
        discrepancies = label_discrepancy(counts)
        weights = sigmoid_discrepancy_weights(counts.sum(axis=1), discrepancies)  # Eq. 11
        consistent = ClassVectors(*consistent_prototypes(relational, held, weights, **self.prototype_rule))
        self.knowledge = {
            RELATIONAL_PROTOTYPES: relational[held],
            RELATIONAL_LABELS: np.nonzero(held)[1].astype(np.int64),
            **consistent.to_config(CONSISTENT_PROTOTYPES),
        }
        self.recorder.update(
            server_round,
            relational_prototypes=int(held.sum()),
            consistent_weight_min=float(weights.min()),
            consistent_weight_max=float(weights.max()),
        )
        return self.average_parameters(updates)


# --- client -----------------------------------------------------------------------------


class FedSCClient(PrototypeClient):
    options_class = FedSCOptions

    def receive(self, parameters, this_round):
        """The global model and (relational prototypes, their labels, consistent prototypes, their
        mask); the prototypes are None before the server has any (round 1)."""
        self.load_shared(parameters)
        num_classes, dim = self.data.num_classes, self.model.feature_dim
        relational = self.received(this_round, RELATIONAL_PROTOTYPES, ArraySpec((None, dim)))
        labels = self.received(this_round, RELATIONAL_LABELS, ArraySpec((None,), ("int64",), nonnegative=True))
        consistent = self.received_masked_vectors(this_round, CONSISTENT_PROTOTYPES)
        self.server_prototypes = None
        if relational is None or labels is None or consistent is None:
            return
        if len(labels) != len(relational) or (labels >= num_classes).any():
            raise ValueError("FedSC: the relational labels do not match the relational prototypes")
        arrays = (relational, labels, consistent.vectors, consistent.mask)
        self.server_prototypes = tuple(torch.from_numpy(a).to(self.device) for a in arrays)

    def batch_loss(self, features, logits, labels, inputs):
        if self.server_prototypes is None:
            return None  # round 1: CE only
        relational, relational_labels, consistent, mask = self.server_prototypes
        options = self.options
        total = features.new_zeros(())
        if options.use_rpcl:
            rpcl = rpcl_loss(  # Eq. 14
                features, labels, relational, relational_labels, options.temperature, options.similarity_norm,
                options.rpcl_form,
            )
            self.record_loss(**{LOSS_KEYS[0]: rpcl})
            total = total + options.lambda_rpcl * rpcl
        if options.use_cpdr:
            cpdr = consistency_loss(features, labels, consistent, mask, options.cpdr_distance)  # Eq. 15
            self.record_loss(**{LOSS_KEYS[1]: cpdr})
            total = total + options.lambda_cpdr * cpdr
        return total


STRATEGY, CLIENT = FedSCStrategy, FedSCClient
