"""What a workload offers the harness and the parameter server."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class State:
    """`params` is what the server shards hold (and checkpoint); `local` is the workers' own
    state, which a server failure does not touch (LDA's topic assignments; None elsewhere)."""

    params: np.ndarray
    local: Any = None


class Workload(Protocol):
    """An iterative-convergent algorithm: `step` turns the state after `iteration` iterations
    into the next one, with randomness drawn from the iteration alone, so that a recovered run
    sees the same mini-batches or samples as the run it is compared with."""

    name: str
    size: int

    def start(self) -> State: ...

    def step(self, state: State, iteration: int) -> State: ...

    def loss(self, state: State) -> float: ...
