"""The rework-cost harness: how many extra iterations a failure costs under each strategy.

A clean reference run sets the loss threshold and the iteration it is first reached. A failure
at iteration T loses one server shard (before the checkpoint due at T is taken); the strategy
recovers from its checkpoint store, the run goes on from T, and the rework cost is the
iterations to the threshold beyond the reference's, interpolating the loss linearly between
the two iterations around the threshold (so a perturbation worth a fraction of an iteration is
not rounded up to a whole one). The algorithm runs in this process (NumPy), with the same
store and strategies the Ray parameter server uses.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bound import contraction_rate, rework_bound
from .layout import Layout
from .store import CheckpointStore
from .strategies import Checkpointer, Strategy
from .workloads import State, Workload


@dataclass(frozen=True)
class Reference:
    """A clean run: its states (iterations 0..horizon), losses, the threshold (the loss at the
    target iteration), the (fractional) iteration it is first reached at, and its measured
    linear rate."""

    states: list[State]
    losses: np.ndarray
    threshold: float
    reached: float
    rate: float
    initial_distance: float


@dataclass(frozen=True)
class Failure:
    """A server shard lost after `iteration`."""

    iteration: int
    lost_shard: int


@dataclass(frozen=True)
class Trial:
    """One failure recovered by one strategy; `rework` in (fractional) iterations."""

    workload: str
    strategy: str
    failure: Failure
    rework: float
    perturbation: float
    bound: float


def reference_run(workload: Workload, target: int, horizon: int) -> Reference:
    """Run `horizon` iterations; the last state stands in for the optimum when the linear rate
    is fitted over the iterations up to the threshold."""
    states = [workload.start()]
    for iteration in range(horizon):
        states.append(workload.step(states[-1], iteration))
    losses = np.array([workload.loss(state) for state in states])
    threshold = float(losses[target])
    reached = crossing(losses, threshold)
    optimum = states[-1].params
    distances = np.array([np.linalg.norm(s.params - optimum)
                          for s in states[:math.ceil(reached) + 1]])
    return Reference(states, losses, threshold, reached, contraction_rate(distances),
                     float(distances[0]))


def crossing(losses: list[float] | np.ndarray, threshold: float, start: int = 0) -> float:
    """The (fractional) iteration at which `losses`, the losses of iterations start, start+1,
    ..., first reach `threshold`, interpolating linearly between the two around it."""
    hit = int(np.argmax(np.asarray(losses) <= threshold))
    if hit == 0:
        return float(start)
    before, after = losses[hit - 1], losses[hit]
    return start + hit - 1 + (before - threshold) / (before - after)


def iterations_to_threshold(workload: Workload, state: State, start: int, threshold: float,
                            limit: int) -> float:
    """The (fractional) iteration, from `start` on, at which the run from `state` reaches
    `threshold`; `limit` when it has not by then."""
    losses = [workload.loss(state)]
    iteration = start
    while losses[-1] > threshold:
        if iteration == limit:
            return float(limit)
        state = workload.step(state, iteration)
        losses.append(workload.loss(state))
        iteration += 1
    return crossing(losses, threshold, start)


def random_failures(reference: Reference, shards: int, count: int, seed: int) -> list[Failure]:
    """`count` failures at iterations drawn before the threshold is reached, each losing a
    shard drawn at random."""
    rng = np.random.default_rng(seed)
    iterations = rng.integers(1, math.ceil(reference.reached), count)
    return [Failure(int(t), int(s)) for t, s in zip(iterations, rng.integers(0, shards, count))]


def run_trials(workload: Workload, reference: Reference, layout: Layout,
               strategies: list[Strategy], failures: list[Failure], folder: Path) -> list[Trial]:
    """Replay the reference once per checkpoint schedule, writing checkpoints to a store under
    `folder`, and recover each failure from that store with each strategy on the schedule."""
    by_schedule: dict = defaultdict(list)
    for strategy in strategies:
        by_schedule[strategy.schedule].append(strategy)
    at: dict[int, list[Failure]] = defaultdict(list)
    for failure in failures:
        at[failure.iteration].append(failure)
    trials = []
    for schedule, group in by_schedule.items():
        store = CheckpointStore(folder / schedule.name.replace(" ", "-"))
        checkpointer = Checkpointer(store, layout, schedule)
        checkpointer.start(reference.states[0].params)
        for iteration in range(1, max(at) + 1):
            live = reference.states[iteration]
            for failure in at.get(iteration, []):
                trials += [_recover(workload, reference, layout, strategy, store, live, failure)
                           for strategy in group]
            checkpointer.after(live.params, iteration)
    return trials


def _recover(workload: Workload, reference: Reference, layout: Layout, strategy: Strategy,
             store: CheckpointStore, live: State, failure: Failure) -> Trial:
    params = strategy.recover(live.params, store, layout, failure.lost_shard)
    limit = 2 * len(reference.states)
    reached = iterations_to_threshold(workload, State(params, live.local), failure.iteration,
                                      reference.threshold, limit)
    perturbation = float(np.linalg.norm(params - live.params))
    return Trial(workload.name, strategy.name, failure, reached - reference.reached, perturbation,
                 rework_bound(reference.rate, perturbation, reference.initial_distance,
                              failure.iteration))
