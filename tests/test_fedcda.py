"""FedCDA: Eq. 8's objective and the batch selection on hand-checked numbers, and its strategy on
hand-built fit results (FedAvg during the warm-up, then each client's cached model nearest the others)."""

import json

import numpy as np
import pytest
from fakes import start_round
from flwr.common import parameters_to_ndarrays
from test_baselines import assert_moved, reply, shifted, strategy_for

from protofl.strategies.fedcda import best_combination


def test_the_smoothness_weighs_the_divergence_against_the_loss():
    # fixed: w = (0, 0), a = 1, F = 0; the batch's one client: (2, 0) with F = 0, or (1, 0) with F = 1.
    # (2, 0): mean (1, 0), loss 0, variance (1 + 1) / 2 = 1; (1, 0): mean (0.5, 0), loss 1 / 2, variance 0.25
    candidates, weights, losses = [np.array([2.0, 0.0]), np.array([1.0, 0.0])], [1.0, 1.0], [0.0, 1.0]
    for smoothness, expected in ((1.0, ((0,), 0.5)), (0.5, ((0,), 0.25)), (4.0, ((1,), 0.5 + 2 * 0.25))):
        choice, objective = best_combination(np.zeros(2), 1.0, 0.0, candidates, weights, losses, [range(2)],
                                             smoothness)
        assert choice == expected[0] and objective == pytest.approx(expected[1], rel=1e-12)


def test_a_batch_tries_every_combination_of_its_clients_cached_models():
    # two clients, nothing fixed, weights 1 and 3, equal losses 0.5, L = 2: client x holds 0 or 3,
    # client y 1 or 5 (1-d). Objective 0.5 + sum a (w - mean)^2 / 4:
    # (0, 1): mean 0.75, (0.5625 + 3 * 0.0625) / 4 = 0.1875; (0, 5): mean 3.75, (14.0625 + 3 * 1.5625) / 4;
    # (3, 1): mean 1.5, (2.25 + 3 * 0.25) / 4 = 0.75; (3, 5): mean 4.5, (2.25 + 3 * 0.25) / 4 = 0.75
    candidates = [np.array([0.0]), np.array([3.0]), np.array([1.0]), np.array([5.0])]
    choice, objective = best_combination(np.zeros(1), 0.0, 0.0, candidates, [1, 1, 3, 3], [0.5] * 4,
                                         [range(0, 2), range(2, 4)], 2.0)
    assert choice == (0, 2) and objective == pytest.approx(0.5 + 0.1875, rel=1e-12)


def test_fedavg_in_the_warmup_then_each_client_selects_the_cached_model_nearest_the_others(tmp_path):
    strategy = strategy_for("fedcda", tmp_path, {"warmup-rounds": 1, "cache-size": 2, "weighted": False})
    x = strategy.shared_weights()
    start_round(strategy, [0, 1])
    # round 1, the warm-up: the plain mean of 0 and 1
    assert_moved(parameters_to_ndarrays(strategy.aggregate_fit(1, [reply(0, x, 10), reply(1, shifted(x, 1.0), 30)],
                                                               [])[0]), x, 0.5)
    # round 2: caches {0, 4} and {1, 9}, equal losses: the older models are the nearest pair, and the
    # global model is their mean
    strategy.admission.sent_parameters = x
    new, metrics = strategy.aggregate_fit(2, [reply(0, shifted(x, 4.0), 10), reply(1, shifted(x, 9.0), 30)], [])
    assert metrics["accepted"] == 2 and strategy.selected == {0: 0, 1: 0}
    assert_moved(parameters_to_ndarrays(new), x, 0.5)
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][1]
    entries = sum(a.size for a, trained in zip(x, strategy.trained_entries) if trained)
    assert record["cda_older_selected"] == 2
    # F = 1; each model 0.5 from the mean over every trained entry: 1 + (L / 2) * 0.25 * entries
    assert record["cda_objective"] == pytest.approx(1 + 0.125 * entries, rel=1e-6)
    # round 3, client 1 alone with 2: its cache {9, 2}; client 0's selection (0) stays, and 2 is nearer
    # it than 9 is; the mean over both clients' selections: (0 + 2) / 2
    start_round(strategy, [1], num_partitions=2)
    new, _ = strategy.aggregate_fit(3, [reply(1, shifted(x, 2.0), 30)], [])
    assert strategy.selected == {0: 0, 1: 1}
    assert_moved(parameters_to_ndarrays(new), x, 1.0)


def two_rounds_at_a_small_smoothness(tmp_path, first_loss, second_loss):
    """Round 1 (the warm-up): both clients send the initial model with ``first_loss``; round 2: they
    send it moved by 4 and 8 with ``second_loss``. Returns (strategy, the initial model, round 2's
    global model, its metrics)."""
    strategy = strategy_for("fedcda", tmp_path, {"warmup-rounds": 1, "cache-size": 2, "smoothness": 1e-6})
    x = strategy.shared_weights()
    start_round(strategy, [0, 1])
    strategy.aggregate_fit(1, [reply(0, x, 10, **{"train-loss": first_loss}),
                               reply(1, x, 10, **{"train-loss": first_loss})], [])
    new, metrics = strategy.aggregate_fit(2, [reply(0, shifted(x, 4.0), 10, **{"train-loss": second_loss}),
                                              reply(1, shifted(x, 8.0), 10, **{"train-loss": second_loss})], [])
    return strategy, x, parameters_to_ndarrays(new), metrics


def test_a_lower_loss_outweighs_a_small_divergence_at_a_small_smoothness(tmp_path):
    strategy, x, new, _ = two_rounds_at_a_small_smoothness(tmp_path, 2.0, 0.5)
    assert strategy.selected == {0: 1, 1: 1}
    assert_moved(new, x, 6.0)


def test_a_loss_claimed_near_the_float_limit_makes_those_models_the_least_chosen(tmp_path):
    # a client's loss is its own claim: 1e308 (finite, admitted) times its training size overflows a
    # float64; the round goes on, each client's model with the loss it can stand behind is selected
    strategy, x, new, metrics = two_rounds_at_a_small_smoothness(tmp_path, 0.5, 1e308)
    assert metrics["accepted"] == 2 and strategy.selected == {0: 0, 1: 0}
    assert_moved(new, x, 0.0)
    record = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"][1]
    assert np.isfinite(record["cda_objective"])
