"""A parameter server on Ray: shards are restartable actors, a worker actor computes updates,
and the driver writes checkpoints by the strategy's schedule. A shard killed with
`ray.kill(actor, no_restart=False)` is restarted by Ray, reloads its blocks from the store, and
the driver applies the strategy's recovery to the rest (nothing for partial recovery, a full
rollback for the traditional strategy)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import ray

from .harness import Failure, crossing
from .layout import Layout
from .shard import ParameterShard, UpdateWorker
from .store import CheckpointStore
from .strategies import Checkpointer, Strategy
from .workloads import Workload


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ShardActor(ParameterShard):
    def __init__(self, shard: int, layout: Layout, initial: dict[int, np.ndarray],
                 store: str) -> None:
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__(shard, layout, initial, store, restarted)


WorkerActor = ray.remote(UpdateWorker)


@dataclass(frozen=True)
class Restart:
    """A shard found restarted at the pull of `iteration`."""

    iteration: int
    shard: int


@dataclass
class ParameterServer:
    """Trains `make()` with its parameters on `layout.shards` shard actors, checkpointing to
    the store in `folder` as `strategy` says."""

    make: Callable[[], Workload]
    layout: Layout
    strategy: Strategy
    folder: Path
    restarts: list[Restart] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = CheckpointStore(self.folder)
        self.worker = WorkerActor.remote(self.make)
        initial = ray.get(self.worker.start.remote())
        blocks = self.layout.split(initial)
        self.shards = [ShardActor.remote(shard, self.layout,
                                         {b: blocks[b] for b in self.layout.shard_blocks(shard)},
                                         str(self.folder))
                       for shard in range(self.layout.shards)]
        self.checkpointer = Checkpointer(self.store, self.layout, self.strategy.schedule)
        self.checkpointer.start(initial)

    def params(self, iteration: int) -> np.ndarray:
        """The parameter vector pulled from the shards, after recovering any restarted shard."""
        params = np.empty(self.layout.size)
        pulled = ray.get([shard.pull.remote() for shard in self.shards])
        for blocks, _ in pulled:
            for block, values in blocks.items():
                params[self.layout.slices[block]] = values
        for shard, (_, restarted) in enumerate(pulled):
            if restarted:
                self.restarts.append(Restart(iteration, shard))
                params = self._recover(params, shard)
        return params

    def step(self, iteration: int) -> None:
        """One iteration: pull, compute the update on the worker, push it, checkpoint."""
        params = self.params(iteration)
        delta = ray.get(self.worker.update.remote(params, iteration))
        self._push(delta)
        self.checkpointer.after(params + delta, iteration + 1)

    def loss(self, iteration: int) -> float:
        return ray.get(self.worker.loss.remote(self.params(iteration)))

    def kill(self, shard: int) -> None:
        """Inject a failure: kill a shard's actor and wait until Ray has restarted it (a call
        made just after `ray.kill` may still reach the old process)."""
        actor = self.shards[shard]
        old = ray.get(actor.process.remote())
        ray.kill(actor, no_restart=False)
        while ray.get(actor.process.remote()) == old:
            time.sleep(0.01)

    def train(self, threshold: float, limit: int, failure: Failure | None = None) -> float:
        """Iterate until the loss reaches `threshold` (or `limit` iterations), killing the
        failure's shard after its iteration; returns the (fractional) iteration it was reached."""
        losses = []
        for iteration in range(limit + 1):
            if failure is not None and iteration == failure.iteration:
                self.kill(failure.lost_shard)
            losses.append(self.loss(iteration))
            if losses[-1] <= threshold or iteration == limit:
                break
            self.step(iteration)
        return crossing(losses, threshold) if losses[-1] <= threshold else float(limit)

    def close(self) -> None:
        for actor in [*self.shards, self.worker]:
            ray.kill(actor)

    def _recover(self, params: np.ndarray, lost: int) -> np.ndarray:
        """Apply the strategy's recovery for the lost shard to the other shards too."""
        recovered = self.strategy.recover(params, self.store, self.layout, lost)
        self._push(recovered - params)
        return recovered

    def _push(self, delta: np.ndarray) -> None:
        ray.get([shard.push.remote({b: delta[self.layout.slices[b]]
                                    for b in self.layout.shard_blocks(index)})
                 for index, shard in enumerate(self.shards)])
