"""Multinomial logistic regression by mini-batch SGD on scikit-learn's bundled digits."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .base import State


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    features = np.hstack([data.data / 16.0, np.ones((len(data.data), 1))])  # bias column
    return features, data.target


@dataclass
class LogisticRegression:
    """Softmax regression with an L2 penalty (strongly convex, so SGD converges linearly to a
    noise ball); the parameters are the (features x classes) weights, row by row."""

    batch: int = 256
    rate: float = 2.0
    penalty: float = 1e-3
    seed: int = 0
    name: str = "mlr"
    features: np.ndarray = field(init=False, repr=False)
    labels: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.features, self.labels = _digits()
        self.classes = int(self.labels.max()) + 1
        self.size = self.features.shape[1] * self.classes

    def start(self) -> State:
        rng = np.random.default_rng(self.seed)
        return State(rng.normal(0.0, 0.01, self.size))

    def step(self, state: State, iteration: int) -> State:
        rows = np.random.default_rng((self.seed, iteration)).choice(
            len(self.labels), self.batch, replace=False)
        weights = state.params.reshape(-1, self.classes)
        error = self._probabilities(self.features[rows], weights)
        error[np.arange(self.batch), self.labels[rows]] -= 1.0
        gradient = self.features[rows].T @ error / self.batch + self.penalty * weights
        return State((weights - self.rate * gradient).ravel())

    def loss(self, state: State) -> float:
        weights = state.params.reshape(-1, self.classes)
        probabilities = self._probabilities(self.features, weights)
        likelihood = probabilities[np.arange(len(self.labels)), self.labels]
        return float(-np.log(likelihood).mean() + 0.5 * self.penalty * np.sum(weights ** 2))

    @staticmethod
    def _probabilities(features: np.ndarray, weights: np.ndarray) -> np.ndarray:
        logits = features @ weights
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return exp / exp.sum(axis=1, keepdims=True)
