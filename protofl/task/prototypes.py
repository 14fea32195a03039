"""Prototype math that methods share (pure numpy / torch, no Flower).

- :func:`aggregate_prototypes`: per-class weighted mean of client prototypes (FedProto Eq. 5,
  FedCoSR Eq. 6, FedSA, FedSC Eq. 12);
- :func:`neighbour_merge`: each client's class vector averaged with its M nearest peers (FedSC
  Eq. 7-9 with the angle-wise rule, FedSKC Eq. 1 with pairwise L2);
- :func:`multi_positive_infonce`: InfoNCE of queries against labelled keys, every key of the query's
  label a positive, with the similarity normaliser U (FedSC Eq. 13-14, FedSKC Eq. 2-3);
- :func:`sigmoid_discrepancy_weights`: aggregation weights from sizes and discrepancies (FedSC
  Eq. 11, FedSKC Eq. 4).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import torch

from protofl.task.robust import RobustRule, robust_mean

NeighbourMetric = Literal["angle", "l1", "l2", "cosine", "kl"]
SimilarityNorm = Literal["mean-distance", "none"]
PrototypeWeighting = Literal["count", "uniform"]
NEIGHBOUR_METRICS = get_args(NeighbourMetric)
SIMILARITY_NORMS = get_args(SimilarityNorm)
PROTOTYPE_WEIGHTINGS = get_args(PrototypeWeighting)
WEIGHT_FORMS = ("normalized", "raw-counts")


def aggregate_prototypes(
    prototypes: np.ndarray, counts: np.ndarray, weighting: PrototypeWeighting = "count",
    rule: RobustRule = "method", trim_fraction: float = 0.2,
) -> tuple[np.ndarray, np.ndarray]:
    """K x C x d client prototypes and K x C counts -> (C x d global prototypes, C mask).

    Class c's global prototype is the mean of the clients' prototypes of c weighted by their
    counts of c (``count``) or unweighted over the clients holding c (``uniform``), or another
    ``rule`` of :mod:`protofl.task.robust` over them. The mask marks classes held by at least one
    client; their rows are zero otherwise.
    """
    if weighting not in PROTOTYPE_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {PROTOTYPE_WEIGHTINGS}, got {weighting!r}")
    held = counts > 0
    weights = counts.astype(np.float64) if weighting == "count" else held.astype(np.float64)
    total = weights.sum(axis=0)
    mask = total > 0
    global_prototypes = np.zeros(prototypes.shape[1:], dtype=np.float32)
    if rule != "method":
        global_prototypes[mask] = robust_class_means(prototypes, weights, rule, trim_fraction)[mask]
        return global_prototypes, mask
    summed = np.einsum("kc,kcd->cd", weights, prototypes.astype(np.float64))
    global_prototypes[mask] = summed[mask] / total[mask, None]
    return global_prototypes, mask


def robust_class_means(vectors: np.ndarray, weights: np.ndarray, rule: RobustRule, trim_fraction: float) -> np.ndarray:
    """K x C x d vectors, K x C weights -> C x d (float64): per class, ``rule`` over the clients with
    a positive weight for it; zero rows for classes nobody holds."""
    result = np.zeros(vectors.shape[1:], dtype=np.float64)
    for c in np.flatnonzero((weights > 0).any(axis=0)):
        holders = weights[:, c] > 0
        result[c] = robust_mean(vectors[holders, c], weights[holders, c], rule, trim_fraction)
    return result


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of ``a`` (n x d) against ``b`` (m x d): n x m."""
    a_unit = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b_unit = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return a_unit @ b_unit.T


def neighbour_distances(vectors: np.ndarray, metric: str) -> np.ndarray:
    """n x n dissimilarities between n clients' vectors of one class (row k: from client k).

    ``angle`` (FedSC Eq. 7-8): phi_k = cos(mean vector, v_k), distance |phi_k - phi_k'|.
    ``l1`` / ``l2`` / ``cosine`` (1 - cos) / ``kl`` (KL(softmax v_k || softmax v_k')): pairwise, the
    alternatives of FedSC's Table 5; ``l2`` is FedSKC's rule.
    """
    v = np.asarray(vectors, dtype=np.float64)
    if metric == "angle":
        phi = _cosine(v, v.mean(axis=0, keepdims=True))[:, 0]
        return np.abs(phi[:, None] - phi[None, :])
    if metric == "l1":
        return np.abs(v[:, None] - v[None]).sum(axis=-1)
    if metric == "l2":
        return np.linalg.norm(v[:, None] - v[None], axis=-1)
    if metric == "cosine":
        return 1.0 - _cosine(v, v)
    if metric == "kl":
        log_p = v - v.max(axis=1, keepdims=True)
        log_p = log_p - np.log(np.exp(log_p).sum(axis=1, keepdims=True))
        return (np.exp(log_p)[:, None] * (log_p[:, None] - log_p[None])).sum(axis=-1)
    raise ValueError(f"neighbour metric must be one of {NEIGHBOUR_METRICS}, got {metric!r}")


def neighbour_merge(vectors: np.ndarray, num_neighbours: int, metric: str) -> np.ndarray:
    """Each row averaged with its ``num_neighbours`` nearest other rows (all of them when fewer;
    ties go to the lower index): (v_k + sum of neighbours) / (1 + #neighbours)."""
    v = np.asarray(vectors, dtype=np.float64)
    n = len(v)
    distances = neighbour_distances(v, metric) if n > 1 else np.zeros((1, 1))
    np.fill_diagonal(distances, np.inf)
    take = min(num_neighbours, n - 1)
    merged = np.empty_like(v)
    for k in range(n):
        neighbours = np.argsort(distances[k], kind="stable")[:take]
        merged[k] = (v[k] + v[neighbours].sum(axis=0)) / (1 + take)
    return merged.astype(np.float32)


def multi_positive_infonce(
    queries: torch.Tensor,
    labels: torch.Tensor,
    keys: torch.Tensor,
    key_labels: torch.Tensor,
    temperature: float,
    similarity_norm: str = "mean-distance",
) -> torch.Tensor:
    """Mean over the batch of -log(sum_pos exp(s/tau) / sum_all exp(s/tau)).

    s(q, k) = cos(q, k) / U(k), U(k) = mean over the batch of ||q - k||_2, detached
    (``mean-distance``, FedSC Eq. 13 / FedSKC Eq. 2), or the plain cosine (``none``, both codes).
    The keys whose label is the query's are its positives, all others negatives. Queries whose
    class has no key are left out; zero when none is left.
    """
    if similarity_norm not in SIMILARITY_NORMS:
        raise ValueError(f"similarity norm must be one of {SIMILARITY_NORMS}, got {similarity_norm!r}")
    positive = labels[:, None] == key_labels[None, :]
    has_positive = positive.any(dim=1)
    if not bool(has_positive.any()):
        return queries.new_zeros(())
    queries, positive = queries[has_positive], positive[has_positive]
    keys = keys.to(queries.dtype)
    similarity = torch.nn.functional.normalize(queries, dim=1) @ torch.nn.functional.normalize(keys, dim=1).T
    if similarity_norm == "mean-distance":
        similarity = similarity / torch.cdist(queries.detach(), keys).mean(dim=0).clamp(min=1e-12)
    logits = similarity / temperature
    positives = logits.masked_fill(~positive, float("-inf"))
    return (torch.logsumexp(logits, dim=1) - torch.logsumexp(positives, dim=1)).mean()


def _shares(values: np.ndarray) -> np.ndarray:
    """values / their sum (>= 0 each), without overflow; zeros when they sum to 0."""
    with np.errstate(over="ignore"):
        total = values.sum()
    if np.isinf(total):
        values = values / values.max()
        total = values.sum()
    return values / total if total > 0 else np.zeros_like(values)


def sigmoid_discrepancy_weights(sizes: np.ndarray, discrepancies: np.ndarray, form: str = "normalized") -> np.ndarray:
    """Aggregation weights e_k, summing to 1, that favour large clients with a small discrepancy.

    ``normalized``: e_k proportional to sigmoid(n_k / sum n - d_k / sum d) (FedSC Eq. 11).
    ``raw-counts``: sigmoid(n_k - a_k d_k + b_k), a_k = d_k / sum d, b_k = n_k / sum n (FedSKC Eq. 4 as
    printed; with sample counts in the hundreds every sigmoid is 1.0 and the weights are uniform).
    Safe on any finite input: when every sigmoid underflows, they are compared in log space.
    """
    n = np.asarray(sizes, dtype=np.float64)
    d = np.asarray(discrepancies, dtype=np.float64)
    d_share, n_share = _shares(d), _shares(n)
    if form == "normalized":
        score = n_share - d_share
    elif form == "raw-counts":
        score = n - d_share * d + n_share
    else:
        raise ValueError(f"weight form must be one of {WEIGHT_FORMS}, got {form!r}")
    with np.errstate(over="ignore"):
        sigmoid = 1.0 / (1.0 + np.exp(-score))
    total = sigmoid.sum()
    if not (np.isfinite(total) and total > 0):  # every sigmoid underflowed: compare them in log space
        log_sigmoid = -np.logaddexp(0.0, -score)
        sigmoid = np.exp(log_sigmoid - log_sigmoid.max())
        total = sigmoid.sum()
    return sigmoid / total


def prototype_pairs(means: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (prototype, class) pairs of K clients' class statistics (K x C x d means, K x C counts):
    each client's classes it holds, client by client, class by class (FedGH's and FedTGP's server
    training data)."""
    clients, classes = np.nonzero(counts > 0)
    return means[clients, classes], classes
