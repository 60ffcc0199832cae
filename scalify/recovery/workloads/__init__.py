"""Iterative-convergent workloads, each a step function over a flat parameter vector that
parameter-server shards hold, plus the workers' own state. Data comes from installed packages:
nothing is downloaded."""
from __future__ import annotations

from typing import Callable

from .base import State, Workload
from .lda import GibbsLDA
from .mf import AlternatingLeastSquares
from .mlr import LogisticRegression

WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlr": LogisticRegression,
    "mf": AlternatingLeastSquares,
    "lda": GibbsLDA,
}

__all__ = ["State", "Workload", "WORKLOADS", "LogisticRegression", "AlternatingLeastSquares",
           "GibbsLDA"]
