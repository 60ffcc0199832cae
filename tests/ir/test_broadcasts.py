"""A value one rank computes and broadcasts (Megatron's `broadcast_data`: only tensor-parallel
rank 0 reads the batch) is that rank's computation on every rank when it reads only replicated
inputs: the ranks then run one program and rank symmetry applies."""
import torch
import torch.distributed as dist
from torch import nn

import scalify
from scalify.api import capture_modules
from scalify.placements import Placement
from scalify.ir.broadcasts import with_broadcasts_resolved
from scalify.ir.symmetry import symbolic_program

WORLD, ROWS, HIDDEN, OUT = 2, 3, 4, 6


class Head(nn.Module):
    """relu(2x) times a weight; on the ranks rank 0 computes 2x and broadcasts it from
    `source`, and each rank holds its rows of the weight."""

    def __init__(self, rank: int | None = None, source: int = 0) -> None:
        super().__init__()
        self.rank, self.source = rank, source
        self.w = nn.Parameter(torch.randn(OUT if rank is None else OUT // WORLD, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            data = x * 2
        else:
            data = x * 2 if self.rank == 0 else torch.zeros_like(x)
            dist.broadcast(data, self.source)
        return torch.relu(data) @ self.w.t()


def _rank_graphs(x_placement: Placement) -> list:
    _, ranks = capture_modules(Head(), lambda rank: Head(rank), WORLD,
                               {"x": torch.randn(ROWS, HIDDEN)}, {"x": x_placement})
    return ranks


def test_a_broadcast_of_replicated_inputs_is_the_roots_computation_everywhere() -> None:
    before = _rank_graphs(scalify.Replicate())
    assert symbolic_program(before)[0] is None  # rank 0 computes, the others fill zeros
    after = with_broadcasts_resolved(before, lambda target: True)
    assert all("all_gather" not in {node.op for node in graph} for graph in after)
    assert symbolic_program(after)[0] is not None


def test_a_broadcast_of_a_sharded_input_stays() -> None:
    after = with_broadcasts_resolved(_rank_graphs(scalify.Shard(0)),
                                     lambda target: target != "x")
    assert all("all_gather" in {node.op for node in graph} for graph in after)


def _verify(source: int) -> scalify.Report:
    torch.manual_seed(0)
    return scalify.verify_modules(
        reference=Head(), rank_module_factory=lambda rank: Head(rank, source), world_size=WORLD,
        example_inputs={"x": torch.randn(ROWS, HIDDEN)}, param_placements={"w": scalify.Shard(0)},
        output_placements=[scalify.Shard(1)], numeric=True)


def test_verified_on_one_program() -> None:
    report = _verify(source=0)
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert report.stats["rank_symmetry"] == "used"


def test_a_broadcast_from_the_wrong_rank_is_caught() -> None:
    report = _verify(source=1)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
