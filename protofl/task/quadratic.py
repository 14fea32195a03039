"""The minimum of a convex quadratic form over the probability simplex, exactly (FedPAC's head
combination): min_a a^T P a subject to sum(a) = 1, a >= 0, for a small symmetric positive
semi-definite P (one row per client of a round)."""

from __future__ import annotations

import numpy as np


def simplex_minimum(matrix: np.ndarray, max_iterations: int = 1000) -> np.ndarray:
    """The minimiser of a^T P a over the simplex, by the primal active-set method (Nocedal and Wright,
    Algorithm 16.3), in float64: from the vertex of the smallest diagonal entry, each iteration
    solves the equality-constrained problem on the free coordinates (its KKT system, scaled to a
    unit diagonal, by least squares where P is singular there), steps towards it until a
    coordinate would turn negative, and frees the bound coordinate whose multiplier
    2 (P a)_j - nu is most negative (below -1e-12 of the gradient's largest entry) once none
    blocks. Exact up to rounding, whatever the scales of P's entries (FedPAC: one client's V of
    1e30 beside others of 0.1): at the result the multipliers of the bound coordinates are >= 0
    and the free coordinates share one gradient value nu."""
    p = np.asarray(matrix, np.float64)
    p = (p + p.T) / 2
    n = len(p)
    x = np.zeros(n)
    x[int(np.argmin(np.diag(p)))] = 1.0
    free = x > 0
    diagonal = np.diag(p)
    # the KKT system in the coordinates a_i sqrt(P_ii), whose form has a unit diagonal: a cut-off
    # relative to its largest singular value leaves every other coordinate's equation in
    scale = np.where(diagonal > 0, 1.0 / np.sqrt(np.where(diagonal > 0, diagonal, 1.0)), 1.0)
    for _ in range(max_iterations):
        index = np.flatnonzero(free)
        k = len(index)
        s = scale[index]
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k] = 2 * s[:, None] * p[np.ix_(index, index)] * s[None, :]
        kkt[:k, k] = kkt[k, :k] = -s
        target = np.zeros(k + 1)
        target[k] = -1.0
        solution = np.linalg.lstsq(kkt, target, rcond=None)[0]  # [a_free / s; nu]
        step = np.zeros(n)
        step[index] = s * solution[:k] - x[index]
        if np.abs(step).max() <= 1e-12:  # (x sums to 1)
            gradient = 2 * p @ x
            nu = float(np.mean(gradient[index]))
            multipliers = np.where(free, 0.0, gradient - nu)
            j = int(np.argmin(multipliers))
            # relative to the gradient at x, in which a bound coordinate's own diagonal has no part:
            # one huge entry there does not stop the search where it started
            if multipliers[j] >= -1e-12 * max(float(np.abs(gradient).max()), np.finfo(np.float64).tiny):
                return x
            free[j] = True
            continue
        blocking = [(-x[i] / step[i], i) for i in index if step[i] < 0]
        length, stop = min(blocking, default=(1.0, -1))
        length = min(length, 1.0)
        x = x + length * step
        if length < 1.0:
            x[stop] = 0.0
            free[stop] = False
        x = np.maximum(x, 0.0)
        x /= x.sum()
    return x
