"""DP prototypes (task/privacy): the clip-and-noise step and its accounting."""

import numpy as np
import pytest

from protofl.task.privacy import ReleaseLedger, privatize_class_means, prototype_epsilon


def test_rows_are_clipped_and_noised_and_absent_classes_stay_zero():
    means = np.array([[3.0, 4.0], [0.3, 0.4], [7.0, 7.0]], np.float32)
    counts = np.array([5, 2, 0])
    exact = privatize_class_means(means, counts, clip=1.0, noise=0.0, rng=np.random.default_rng(0))
    np.testing.assert_allclose(exact, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], rtol=1e-6)
    draws = np.stack([privatize_class_means(means, counts, 1.0, 2.0, np.random.default_rng(s)) for s in range(2000)])
    assert (draws[:, 2] == 0).all()
    noise = draws[:, :2] - exact[:2]
    assert noise.mean() == pytest.approx(0.0, abs=0.05) and noise.std() == pytest.approx(2.0, rel=0.05)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
    assert prototype_epsilon(1.0, 0, 1e-5) == 0.0 and prototype_epsilon(0.0, 3, 1e-5) == float("inf")
    eps = [prototype_epsilon(noise, 10, 1e-5) for noise in (1.0, 2.0, 4.0)]
    assert eps[0] > eps[1] > eps[2] > 0
    assert prototype_epsilon(2.0, 1, 1e-5) < prototype_epsilon(2.0, 10, 1e-5) < prototype_epsilon(2.0, 100, 1e-5)
    # the sensitivity is 2 * clip: noise 2 is the plain Gaussian mechanism with noise multiplier 1
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0), 10)
    assert prototype_epsilon(2.0, 10, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))


def test_the_ledger_counts_each_partitions_releases_and_the_run_pays_for_the_most_frequent():
    ledger = ReleaseLedger()
    assert ledger.epsilon(2.0, 1e-5) is None
    ledger.record([0, 1])
    ledger.record([1, 2])
    ledger.record([1])
    assert ledger.epsilon(2.0, 1e-5) == prototype_epsilon(2.0, 3, 1e-5)  # partition 1: three releases
    resumed = ReleaseLedger(ledger.state())  # through a checkpoint's JSON keys
    assert ledger.state() == {"0": 1, "1": 3, "2": 1} and resumed.releases == ledger.releases
