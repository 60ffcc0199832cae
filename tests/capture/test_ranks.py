"""Ranks captured in forked processes: thread pools do not survive fork, so the children run
torch single-threaded (a parallel op in a child of a parent that used OpenMP would hang) and
never collect what they inherited (an egglog e-graph the parent left to the garbage collector
waits on rayon's threads when dropped); a child that dies is a clear error, not a parent
waiting forever."""
import gc
import os

import pytest
import torch
from egglog import EGraph, i64

from scalify.capture.ranks import capture_ranks
from scalify.errors import CaptureError

WORLD = 2
INPUTS = {"x": torch.ones(4, 4)}


def _call(module, inputs):
    return module(inputs["x"])


def test_forked_ranks_capture_after_the_parent_ran_parallel_ops():
    torch.randint(0, 1000, (1 << 20,)).unique()  # starts OpenMP's pool in this process
    threads = {}

    def factory(rank):
        threads[rank] = torch.get_num_threads()
        torch.randint(0, 1000, (1 << 20,)).unique()  # would hang in a child with the pool
        return torch.nn.Linear(4, 4)

    graphs = capture_ranks(factory, WORLD, lambda rank: INPUTS, _call, workers=2)
    assert len(graphs) == WORLD
    assert torch.get_num_threads() == threads[0]  # this process keeps its threads


class _Cycle:
    pass


def _egraph_left_to_the_collector() -> None:
    egraph = EGraph()
    egraph.register(i64(1) + i64(2))
    egraph.run(3)  # starts egglog's thread pool
    cycle = _Cycle()
    cycle.itself, cycle.egraph = cycle, egraph


def test_forked_ranks_capture_while_the_parent_left_an_egraph_to_the_collector():
    def factory(rank):
        gc.collect()  # would drop the e-graph in a child that collects what it inherited
        return torch.nn.Linear(4, 4)

    gc.disable()
    try:
        _egraph_left_to_the_collector()
        graphs = capture_ranks(factory, WORLD, lambda rank: INPUTS, _call, workers=2)
    finally:
        gc.enable()
        gc.collect()
    assert len(graphs) == WORLD


def test_a_child_that_dies_is_a_capture_error():
    def factory(rank):
        if rank == 1:
            os._exit(9)
        return torch.nn.Linear(4, 4)

    with pytest.raises(CaptureError, match=r"ranks \[1\] died"):
        capture_ranks(factory, WORLD, lambda rank: INPUTS, _call, workers=2)
