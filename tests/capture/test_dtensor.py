"""Capturing DTensor-parallel ranks: each rank's local program, its collectives and source lines."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import scalify
from scalify.capture.dtensor import placements_held
from scalify.capture.ranks import capture_rank
from scalify.errors import CaptureError
from scalify.placements import Shard

HIDDEN, FFN = 8, 16


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tp_mlp(rank: int, world: int, plan: dict | None = None) -> nn.Module:
    with torch.device("meta"):
        model = MLP()
    mesh = init_device_mesh("cpu", (world,))
    return parallelize_module(model, mesh, plan or {"up": ColwiseParallel(), "down": RowwiseParallel()})


def call(module: nn.Module, inputs: dict) -> torch.Tensor:
    return module(**inputs)


def captured(rank: int, world: int, plan: dict | None = None):
    inputs = {"x": torch.empty(2, 3, HIDDEN, device="meta")}
    return capture_rank(functools.partial(tp_mlp, world=world, plan=plan), rank, world, inputs, call)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_is_captured_in_local_shapes_with_its_collective(world: int) -> None:
    graph = captured(world - 1, world)
    shapes = {node.name: node.shape for node in graph.placeholders()}
    assert shapes == {"up.weight": (FFN // world, HIDDEN), "down.weight": (HIDDEN, FFN // world),
                      "x": (2, 3, HIDDEN)}
    ops = [node.op for node in graph if node.op != "placeholder"]
    assert ops.count("all_reduce") == 1 and ops.count("matmul") == 2
    (reduce,) = [node for node in graph if node.op == "all_reduce"]
    assert reduce.attr("group") == tuple(range(world))  # the group name resolved to ranks
    assert "self.down(" in reduce.source.code  # DTensor's output hook, called for `down`


def test_consecutive_ranks_of_different_worlds_do_not_share_sharding_decisions() -> None:
    assert captured(0, 4).placeholders()[0].shape == (FFN // 4, HIDDEN)
    assert captured(0, 2).placeholders()[0].shape == (FFN // 2, HIDDEN)


def test_local_ops_keep_the_users_source_line() -> None:
    graph = captured(0, 2)
    relu = next(node for node in graph if node.op == "relu")
    assert relu.source.file == __file__ and "torch.relu" in relu.source.code


def test_a_dtensor_error_names_the_module_and_line() -> None:
    def mixed(rank: int) -> nn.Module:
        model = tp_mlp(rank, 2, {"up": ColwiseParallel(use_local_output=False)})
        return model  # up returns a DTensor, down is a plain Linear: DTensor refuses the mix

    inputs = {"x": torch.empty(2, 3, HIDDEN, device="meta")}
    with pytest.raises(CaptureError, match=r"^down at .*: .*mixed torch.Tensor and DTensor"):
        capture_rank(mixed, 0, 2, inputs, call)


def test_the_placements_of_dtensor_parameters_are_read_from_every_rank() -> None:
    world = 2
    held = placements_held([captured(rank, world) for rank in range(world)])
    assert held == {"up.weight": Shard(0), "down.weight": Shard(1)}


def test_a_parallelized_module_verifies_with_no_placements_stated() -> None:
    """The ranks' DTensor parameters say how they are cut: the user states nothing."""
    report = scalify.verify_modules(
        reference=MLP(), rank_module_factory=lambda rank: tp_mlp(rank, 2), world_size=2,
        example_inputs={"x": torch.randn(2, 3, HIDDEN)}, numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert report.stats["rank_symmetry"] == "used"  # the ranks' layouts differ; programs do not
