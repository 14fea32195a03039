"""Robust aggregation rules (pure numpy, no Flower).

Rules for averaging K clients' vectors (``aggregation`` for parameters, ``prototype-aggregation``
for each class's prototypes, anchors' inputs and knowledge vectors):

- ``method``: the method's own weighted mean;
- ``median``: the coordinate-wise median (Yin et al., ICML 2018), unweighted;
- ``trimmed-mean``: per coordinate, the ``trim-fraction`` largest and smallest values dropped, the
  rest averaged (Yin et al.), unweighted;
- ``norm-clip``: each vector's deviation from a centre clipped to the median deviation norm, then
  the method's weighted mean (Sun et al., 2019, with an adaptive bound). The centre of parameters
  is the global model the clients trained from, of prototypes the class's coordinate-wise median.

The default screen, which drops an update before any rule sees it, is
:mod:`protofl.federation.screen`.
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

import numpy as np

from protofl.task.weights import weighted_average

RobustRule = Literal["method", "median", "trimmed-mean", "norm-clip"]
ROBUST_RULES = get_args(RobustRule)


def trimmed_mean(stack: np.ndarray, trim_fraction: float) -> np.ndarray:
    """Coordinate-wise mean over axis 0 after dropping floor(trim_fraction * K) values at each end
    (at least one value is kept)."""
    k = len(stack)
    cut = min(int(np.floor(trim_fraction * k)), (k - 1) // 2)
    return np.sort(stack, axis=0)[cut : k - cut].mean(axis=0)


def clip_factors(deviation_norms: np.ndarray) -> np.ndarray:
    """Per client, min(1, median norm / norm): what scales its deviation to the median norm."""
    bound = float(np.median(deviation_norms))
    return np.minimum(1.0, bound / np.maximum(deviation_norms, 1e-300))


def robust_mean(
    stack: np.ndarray, weights: Sequence[float], rule: RobustRule, trim_fraction: float = 0.2,
    center: np.ndarray | None = None,
) -> np.ndarray:
    """K x ... vectors -> their aggregate (float64) under ``rule``; ``weights`` (>= 0, not all 0)
    serve ``method`` and ``norm-clip``, whose centre defaults to the coordinate-wise median."""
    stack = np.asarray(stack, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if rule == "median":
        return np.median(stack, axis=0)
    if rule == "trimmed-mean":
        return trimmed_mean(stack, trim_fraction)
    if rule == "norm-clip":
        center = np.median(stack, axis=0) if center is None else np.asarray(center, dtype=np.float64)
        deviations = stack - center
        norms = np.linalg.norm(deviations.reshape(len(stack), -1), axis=1)
        stack = center + deviations * clip_factors(norms).reshape((-1,) + (1,) * (stack.ndim - 1))
    elif rule != "method":
        raise ValueError(f"aggregation rule must be one of {ROBUST_RULES}, got {rule!r}")
    return np.tensordot(w / w.sum(), stack, axes=1)


def robust_average_layers(
    clients: Sequence[Sequence[np.ndarray]], weights: Sequence[float], rule: RobustRule,
    trim_fraction: float = 0.2, reference: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Clients' parameter lists -> one list, each array in its layer's dtype. ``norm-clip`` clips
    each client's whole update (all layers, deviation from ``reference``) to the median update norm."""
    dtypes = [np.asarray(layer).dtype for layer in clients[0]]
    if rule == "norm-clip":
        if reference is None:
            raise ValueError("norm-clip needs the parameters the clients trained from")
        norms = np.sqrt([
            sum(float(np.sum((a.astype(np.float64) - r) ** 2)) for a, r in zip(client, reference))
            for client in clients
        ])
        clients = [
            [r + (a.astype(np.float64) - r) * f for a, r in zip(client, reference)]
            for client, f in zip(clients, clip_factors(norms))
        ]
        rule = "method"
    if rule == "method":
        averaged = weighted_average(clients, weights)
    else:
        stacks = (np.stack([client[i] for client in clients]) for i in range(len(dtypes)))
        averaged = [robust_mean(stack, weights, rule, trim_fraction) for stack in stacks]
    return [a.astype(dtype) for a, dtype in zip(averaged, dtypes)]
