"""Ranks captured in forked processes: the children run torch single-threaded (OpenMP's thread
pool does not survive fork, so a parallel op in a child of a parent that used it would hang),
and a child that dies is a clear error, not a parent waiting forever."""
import os

import pytest
import torch

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


def test_a_child_that_dies_is_a_capture_error():
    def factory(rank):
        if rank == 1:
            os._exit(9)
        return torch.nn.Linear(4, 4)

    with pytest.raises(CaptureError, match=r"ranks \[1\] died"):
        capture_ranks(factory, WORLD, lambda rank: INPUTS, _call, workers=2)
