"""Rank inputs are free values in every window: two ranks' parameters of one name share a
placeholder term, and a window that defined them by it would make them one value (each rank's
shard of a weight equal to every other's)."""
import torch
from torch import nn

from scalify.api import capture_modules
from scalify.ir.distributed import merge_ranks
from scalify.verify.verifier import Verifier, VerifyOptions


class Column(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, width, bias=False)

    def forward(self, x):
        return torch.matmul(x, self.proj.weight.t())


def test_no_window_defines_a_rank_parameter_by_its_placeholder():
    ref, ranks = capture_modules(Column(8), lambda rank: Column(4), 2, {"x": torch.randn(3, 8)},
                                 {})
    dist = merge_ranks(ranks)
    weights = [n.name for n in dist.graph if n.op == "placeholder" and "proj.weight" in n.name]
    assert len(weights) == 2
    verifier = Verifier(ref, dist, VerifyOptions())
    assert verifier._definitions(weights) == []
    transposes = [n.name for n in dist.graph if n.op == "transpose"]
    assert len(verifier._definitions(transposes)) == 2  # what reads them is defined
