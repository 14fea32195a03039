"""The math of FedCoSR's table's baselines (pFedMe, Per-FedAvg, FedAMP, FedALA, FedPAC) on hand-checked
numbers, and their options' checks; their two rounds against PFLlib's code are in
tests/test_conformance_pfllib_{personal,adaptive}.py."""

import math

import numpy as np
import pytest
import torch

from protofl.settings import ExperimentSettings
from protofl.strategies import fedamp, get_method
from protofl.strategies.fedala import slice_start
from protofl.strategies.fedamp import attention_weights, pairwise_squared_distances
from protofl.strategies.fedpac import SMALL_WEIGHT, combination_matrix, combination_weights, feature_statistics
from protofl.task import weights
from protofl.task.quadratic import simplex_minimum


def test_the_simplex_minimum_of_a_diagonal_form_weighs_each_coordinate_by_its_inverse():
    # a^T diag(1, 3) a on a1 + a2 = 1: 2 a1 = 6 a2, so a = (3/4, 1/4)
    np.testing.assert_allclose(simplex_minimum(np.diag([1.0, 3.0])), [0.75, 0.25], rtol=0, atol=1e-15)


def test_the_simplex_minimum_leaves_out_a_coordinate_whose_gradient_stays_above():
    # P = [[1, 2], [2, 8]]: on the free edge the optimum would need a2 = -1/5 < 0, so a = (1, 0)
    np.testing.assert_array_equal(simplex_minimum(np.array([[1.0, 2.0], [2.0, 8.0]])), [1.0, 0.0])


@pytest.mark.parametrize("coupling", [1.0, 0.1])
def test_one_huge_diagonal_entry_gets_its_coordinate_no_weight_and_leaves_the_rest_their_minimum(coupling):
    """FedPAC with one client's V = 1e30: at the others' minimum (0, 1/2, 1/2), coordinate 0's
    multiplier is 2 b - 1 (b its coupling). At b = 1 it stays bound: a tolerance of 1e-12 x the
    largest entry (1e18) stopped at the start vertex (0, 1, 0). At b = 0.1 it is freed, its weight
    (1 - 2b) / 2e30: a least-squares cut-off relative to the largest singular value (2e30) made the
    rest nan."""
    p = np.array([[1e30, coupling, coupling], [coupling, 1.0, 0.0], [coupling, 0.0, 1.0]])
    np.testing.assert_allclose(simplex_minimum(p), [0.0, 0.5, 0.5], rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", range(20))
def test_the_simplex_minimum_meets_the_kkt_conditions_of_a_random_semidefinite_form(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    a = rng.normal(size=(n, max(1, n // 2 if seed % 2 else n)))  # odd seeds: singular
    p = a @ a.T
    x = simplex_minimum(p)
    assert abs(x.sum() - 1) < 1e-12 and (x >= 0).all()
    gradient = 2 * p @ x
    nu = gradient[x > 0].mean()
    scale = np.abs(p).max()
    assert np.abs(gradient[x > 0] - nu).max() <= 1e-9 * scale  # free coordinates share the multiplier
    assert (gradient - nu).min() >= -1e-9 * scale  # a bound coordinate's multiplier is >= 0


def test_feature_statistics_are_the_class_share_weighted_means_and_the_variance_over_n():
    # class 0: features (1, 0), (3, 0); class 1: (0, 2); class 2 absent. n = 3, p = (2/3, 1/3, 0)
    features = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1])
    variance, centroids = feature_statistics(features, labels, 3)
    np.testing.assert_allclose(centroids, [[4 / 3, 0.0], [0.0, 2 / 3], [0.0, 0.0]], rtol=1e-15)
    # class 0: p tr(F^T F) / n_0 = 2/3 * 10 / 2, p^2 ||mu||^2 = 4/9 * 4; class 1: 1/3 * 4 - 1/9 * 4
    expected = (2 / 3 * 5 - 4 / 9 * 4 + 1 / 3 * 4 - 1 / 9 * 4) / 3
    assert variance == pytest.approx(expected, rel=1e-14)


def test_the_combination_matrix_is_the_variances_plus_the_centroid_differences_gram():
    variances = np.array([0.5, 1.0, 2.0])
    centroids = np.array([[[1.0, 0.0]], [[0.0, 0.0]], [[1.0, 2.0]]])  # K x C x d with C = 1, d = 2
    # client 0: h_0 - h_j = (0, 0), (1, 0), (0, -2)
    np.testing.assert_array_equal(combination_matrix(0, variances, centroids),
                                  [[0.5, 0, 0], [0, 1 + 1, 0], [0, 0, 2 + 4]])


def test_combination_weights_at_or_below_the_threshold_are_zeroed_without_renormalising():
    weights = combination_weights(np.diag([1.0, 1.0 / SMALL_WEIGHT * 2]))  # a_2 = 1/(1 + 2000) < 1e-3
    assert weights[1] == 0.0 and weights[0] == pytest.approx(2000 / 2001, rel=1e-14)


def test_attention_weights_decay_with_the_squared_distance_and_the_rest_stays_with_the_client():
    xi, own = attention_weights([0.0, 2.0], alpha_k=0.5, sigma=2.0)
    np.testing.assert_allclose(xi, [0.25, 0.25 * math.exp(-1)], rtol=1e-15)
    assert own == pytest.approx(1 - 0.25 - 0.25 * math.exp(-1), rel=1e-15)


def test_every_pairs_squared_distance_comes_from_the_gram_matrix_over_all_the_arrays():
    a, b, c = ([np.array([1.0, 2.0]), np.array([3.0])], [np.array([0.0, 0.0]), np.array([1.0])],
               [np.array([1.0, 2.0]), np.array([5.0])])
    # ||a - b||^2 = 1 + 4 + 4, ||a - c||^2 = 4, ||b - c||^2 = 1 + 4 + 16
    np.testing.assert_array_equal(pairwise_squared_distances([a, b, c]), [[0, 9, 4], [9, 0, 21], [4, 21, 0]])


@pytest.mark.parametrize("bounded", [True, False])
def test_fedamps_cloud_models_from_one_gram_matrix_are_the_per_pair_formula(monkeypatch, bounded):
    """Every cloud model of the server's batched rule against u_i = xi_ii w_i + sum_j xi_ij w_j, each
    distance ||w_i - w_j||^2 a difference per pair, in float64; a client the server has not heard from
    has the initial model as its own and every held model as a peer. Blocks of 5 entries, so that
    arrays span several. The bound: the Gram matrix's dot products of P terms err by at most
    gamma = 2 P eps of ||w_a||^2 + ||w_b||^2 (plus the sum of three terms), dxi_ij <= alpha / sigma^2
    times that, xi_ii takes the sum of those, and u_i sums n weighted models."""
    monkeypatch.setattr(weights, "COLUMNS", 5)
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (7,)]
    initial = [rng.normal(size=s) for s in shapes]
    held = {p: [w + rng.normal(0, 0.3, w.shape) for w in initial] for p in (0, 2, 5)}
    alpha_k, sigma = 0.8, 2.0
    rule = fedamp.FedAMPStrategy.__new__(fedamp.FedAMPStrategy)
    rule.options = fedamp.FedAMPOptions(alpha_k=alpha_k, sigma=sigma, peer_weight_bound=bounded)
    rule.client_models, rule.initial_model, rule._clouds = held, initial, ({}, {})

    entries = sum(int(np.prod(s)) for s in shapes)
    gamma = 2 * (entries + 3) * np.finfo(np.float64).eps
    squared_norm = max(sum(float(np.sum(w ** 2)) for w in m) for m in [initial, *held.values()])
    distance_error = gamma * 2 * squared_norm
    weight_error = len(held) * alpha_k / sigma ** 2 * distance_error
    largest = max(float(np.max(np.abs(w))) for m in [initial, *held.values()] for w in m)
    for partition in (0, 2, 5, 9):
        own = held.get(partition, initial)
        peers = [w for q, w in sorted(held.items()) if q != partition]
        distances = [sum(float(np.sum((x - y) ** 2)) for x, y in zip(own, w)) for w in peers]
        xi, xi_own = attention_weights(distances, alpha_k, sigma, bounded)
        expected = [xi_own * x + sum(weight * w[k] for weight, w in zip(xi, peers)) for k, x in enumerate(own)]
        got = list(rule.broadcast_to(1, partition).values())
        tolerance = 2 * weight_error * largest * (len(peers) + 1) + gamma * largest * (len(peers) + 1)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_allclose(g, e, rtol=0, atol=tolerance)
    assert max(np.max(np.abs(g - e)) for g, e in zip(rule.broadcast_to(1, 0).values(), held[0])) > 1e-3  # it moved


def test_the_slice_start_leaves_room_for_the_whole_slice_and_follows_the_seed():
    starts = {slice_start(10, 8, seed) for seed in range(50)}
    assert starts == {0, 1, 2}
    assert slice_start(10, 10, 3) == 0 and slice_start(10, 8, 7) == slice_start(10, 8, 7)


@pytest.mark.parametrize("method, option, value", [
    ("pfedme", "lambda", -1.0), ("pfedme", "k", 0), ("pfedme", "personal-lr", 0.0), ("pfedme", "beta", float("nan")),
    ("perfedavg", "alpha", 0.0), ("perfedavg", "beta", -1.0), ("fedamp", "sigma", 0.0), ("fedamp", "lambda", -1.0),
    ("fedala", "sample-percent", 0.0), ("fedala", "window", 0), ("fedpac", "lambda", -1.0),
])
def test_a_bad_option_is_one_error_naming_it(method, option, value):
    options_class = get_method(method)[0].options_class
    with pytest.raises(ValueError, match=f"{method}.{option}"):
        options_class.from_settings(ExperimentSettings(method=method, options={option: value}))
