"""SCAR's rework bound for linear convergence."""
import math

import numpy as np
import pytest

from scalify.recovery.bound import contraction_rate, rework_bound


def test_the_rate_envelopes_the_distances():
    assert contraction_rate(10.0 * 0.5 ** np.arange(6)) == pytest.approx(0.5)
    assert contraction_rate(np.array([1.0, 0.9, 0.1])) == pytest.approx(0.9)  # the slowest step


def test_the_bound_on_an_exactly_linear_run():
    """x_k = c^k x_0; jumping back to x_{T-s} at T costs exactly s iterations, as the bound says."""
    rate, start, failure, back = 0.8, 5.0, 12, 3
    perturbation = start * (rate ** (failure - back) - rate ** failure)
    assert rework_bound(rate, perturbation, start, failure) == pytest.approx(back)


def test_the_bound_grows_with_the_perturbation_and_the_failure_iteration():
    assert rework_bound(0.9, 0.0, 1.0, 5) == 0.0
    assert rework_bound(0.9, 0.1, 1.0, 5) < rework_bound(0.9, 0.2, 1.0, 5)
    assert rework_bound(0.9, 0.1, 1.0, 5) < rework_bound(0.9, 0.1, 1.0, 50)
    assert rework_bound(0.9, 0.1, 1.0, 10_000) == pytest.approx(10_000 + math.log(0.1, 1 / 0.9))
    assert rework_bound(1.0, 0.1, 1.0, 5) == math.inf  # no linear rate, no bound
