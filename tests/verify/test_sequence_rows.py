"""Sequence-sharded activations reach a 2-D product through merged rows ([b, s, h] rows merged
into [b*s, h] on each rank's share of the sequence), symbolic and per rank."""
import pytest
import torch
from torch import nn

import scalify
from scalify.verify.verifier import VerifyOptions

IN, WORLD = 6, 2


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, IN)

    def forward(self, x):
        b, s, _ = x.shape
        return self.proj(x).view(b, s, 2, IN // 2)


@pytest.mark.parametrize("symmetry", [True, False], ids=["symbolic", "per-rank"])
def test_sequence_sharded_rows_reach_a_2d_product(symmetry):
    report = scalify.verify_modules(
        reference=Projection(), rank_module_factory=lambda rank: Projection(), world_size=WORLD,
        example_inputs={"x": torch.randn(2, 8, IN)}, input_placements={"x": scalify.Shard(1)},
        output_placements=[scalify.Shard(1)],
        options=VerifyOptions(rank_symmetry=symmetry))
    assert report.verified, report.discrepancies
