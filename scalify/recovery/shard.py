"""The plain classes behind the parameter server's Ray actors: a server shard and a worker."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from .layout import Layout
from .store import CheckpointStore, bytes_array
from .workloads import State, Workload


class ParameterShard:
    """Holds some blocks of the parameter vector. A restarted shard has lost them and reloads
    them from the checkpoint store (SCAR's partial recovery), and says so at its next pull."""

    def __init__(self, shard: int, layout: Layout, initial: dict[int, np.ndarray],
                 store: str | Path, restarted: bool = False) -> None:
        self.blocks = {block: values.copy() for block, values in initial.items()}
        self.store = CheckpointStore(store)
        self.restarted = restarted
        if restarted:
            self.restore()

    def pull(self) -> tuple[dict[int, np.ndarray], bool]:
        """The blocks, and whether this shard was restarted since the last pull."""
        restarted, self.restarted = self.restarted, False
        return self.blocks, restarted

    def push(self, deltas: dict[int, np.ndarray]) -> None:
        """Add a worker's update."""
        for block, delta in deltas.items():
            self.blocks[block] += delta

    def process(self) -> int:
        """The id of the process holding this shard (a restart changes it)."""
        return os.getpid()

    def restore(self) -> None:
        """Reload every block this shard holds from its last checkpoint."""
        for block, saved in self.store.load(self.blocks).items():
            self.blocks[block] = bytes_array(saved.data)


class UpdateWorker:
    """Runs a workload's iterations on pulled parameters, keeping the workers' own state."""

    def __init__(self, make: Callable[[], Workload]) -> None:
        self.workload = make()
        self.local = None

    def start(self) -> np.ndarray:
        """The initial parameters (and the workers' initial state, kept here)."""
        state = self.workload.start()
        self.local = state.local
        return state.params

    def update(self, params: np.ndarray, iteration: int) -> np.ndarray:
        """The change iteration `iteration` makes to `params`."""
        state = self.workload.step(State(params, self.local), iteration)
        self.local = state.local
        return state.params - params

    def loss(self, params: np.ndarray) -> float:
        return self.workload.loss(State(params, self.local))
