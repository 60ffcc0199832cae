"""Checkpoint and recovery strategies (SCAR, ICML 2019).

A schedule says which blocks to save when: every block every C iterations (traditional), or a
fraction r of the blocks every r*C iterations, the same I/O budget, chosen by largest change
since each block was last saved (prioritized), in turn (round-robin) or at random. A recovery
says what a lost shard costs: every block rolled back (traditional) or only the lost shard's
blocks reloaded while the others keep their live values (partial).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .layout import Layout
from .store import CheckpointStore, array_bytes, bytes_array

# (change of each block since its last save, how many to pick, the save's number) -> blocks
Selector = Callable[[np.ndarray, int, int], list[int]]


def every_block(changes: np.ndarray, count: int, turn: int) -> list[int]:
    return list(range(len(changes)))


def largest_change(changes: np.ndarray, count: int, turn: int) -> list[int]:
    return sorted(np.argsort(-changes, kind="stable")[:count].tolist())


def round_robin(changes: np.ndarray, count: int, turn: int) -> list[int]:
    """The next `count` blocks in turn."""
    start = (turn * count) % len(changes)
    return sorted((start + i) % len(changes) for i in range(count))


def random_blocks(seed: int) -> Selector:
    """`count` blocks drawn at random, reproducibly from `seed` and the save's number."""
    def select(changes: np.ndarray, count: int, turn: int) -> list[int]:
        chosen = np.random.default_rng((seed, turn)).choice(len(changes), count, False)
        return sorted(chosen.tolist())
    return select


@dataclass(frozen=True)
class Schedule:
    """Save `fraction` of the blocks (by `select`) at every multiple of `period`."""

    name: str
    period: int
    fraction: float
    select: Selector = field(compare=False)


class Checkpointer:
    """Writes a run's blocks to `store` as `schedule` says, keeping an in-memory copy of what
    the store holds to rank blocks by their change since their last save."""

    def __init__(self, store: CheckpointStore, layout: Layout, schedule: Schedule) -> None:
        self.store, self.layout, self.schedule = store, layout, schedule
        self.count = max(1, round(schedule.fraction * layout.blocks))
        self.saved: np.ndarray | None = None

    def start(self, params: np.ndarray, iteration: int = 0) -> None:
        """Save every block: the state a run begins from."""
        self._save(params, list(range(self.layout.blocks)), iteration)

    def after(self, params: np.ndarray, iteration: int) -> list[int]:
        """Save the blocks due after `iteration`; returns them."""
        if iteration % self.schedule.period:
            return []
        changes = self.layout.block_norms(params - self.saved)
        blocks = self.schedule.select(changes, self.count, iteration // self.schedule.period)
        self._save(params, blocks, iteration)
        return blocks

    def _save(self, params: np.ndarray, blocks: list[int], iteration: int) -> None:
        if self.saved is None:
            self.saved = params.copy()
        values = {b: params[self.layout.slices[b]].copy() for b in blocks}
        self.store.save({b: array_bytes(v) for b, v in values.items()}, iteration)
        for block, value in values.items():
            self.saved[self.layout.slices[block]] = value


def restore(params: np.ndarray, store: CheckpointStore, layout: Layout,
            blocks: list[int]) -> np.ndarray:
    """`params` with `blocks` replaced by their saved values."""
    restored = params.copy()
    for block, saved in store.load(blocks).items():
        restored[layout.slices[block]] = bytes_array(saved.data)
    return restored


def full_rollback(params: np.ndarray, store: CheckpointStore, layout: Layout,
                  lost_shard: int) -> np.ndarray:
    """Traditional recovery: every block back to its checkpoint."""
    return restore(params, store, layout, list(range(layout.blocks)))


def partial_recovery(params: np.ndarray, store: CheckpointStore, layout: Layout,
                     lost_shard: int) -> np.ndarray:
    """SCAR's partial recovery: only the lost shard's blocks come from the checkpoint."""
    return restore(params, store, layout, layout.shard_blocks(lost_shard))


Recovery = Callable[[np.ndarray, CheckpointStore, Layout, int], np.ndarray]


@dataclass(frozen=True)
class Strategy:
    """A checkpoint schedule and the recovery that reads it."""

    name: str
    schedule: Schedule
    recover: Recovery = field(compare=False)


def strategies(period: int, fraction: float, seed: int = 0) -> list[Strategy]:
    """The strategies compared: traditional, partial, and partial recovery over prioritized,
    round-robin and random checkpoints with the same I/O budget (`fraction` of the blocks every
    `fraction * period` iterations)."""
    often = max(1, round(fraction * period))
    full = Schedule("all blocks", period, 1.0, every_block)
    return [Strategy("traditional", full, full_rollback),
            Strategy("partial", full, partial_recovery),
            Strategy("partial + prioritized", Schedule("prioritized", often, fraction,
                                                       largest_change), partial_recovery),
            Strategy("partial + round-robin", Schedule("round-robin", often, fraction,
                                                       round_robin), partial_recovery),
            Strategy("partial + random", Schedule("random", often, fraction,
                                                  random_blocks(seed)), partial_recovery)]
