"""SCAR's worst-case rework bound for a linearly convergent algorithm.

If ||x_k - x*|| <= c^k ||x_0 - x*|| and the run is perturbed by delta at iteration T, it reaches
any ball around x* at most log_{1/c}(1 + c^-T ||delta|| / ||x_0 - x*||) iterations later.
"""
from __future__ import annotations

import math

import numpy as np


def contraction_rate(distances: np.ndarray) -> float:
    """The smallest c with distances[k] <= c^k * distances[0] for every k: the linear rate
    that envelopes a measured run's distances to its optimum."""
    steps = np.arange(1, len(distances))
    ratios = np.maximum(distances[1:], 1e-300) / distances[0]
    return float(np.max(ratios ** (1.0 / steps)))


def rework_bound(rate: float, perturbation: float, initial_distance: float,
                 iteration: int) -> float:
    """The bound on extra iterations for a perturbation of norm `perturbation` at `iteration`;
    infinite when the run showed no linear rate (c >= 1)."""
    if perturbation == 0.0:
        return 0.0
    if rate >= 1.0:
        return math.inf
    exponent = -iteration * math.log(rate) + math.log(perturbation / initial_distance)
    return float(np.logaddexp(0.0, exponent) / -math.log(rate))
