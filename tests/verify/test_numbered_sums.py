"""Relations found by numbering values as polynomials (polynomials.py): a bias added to every
part of a partial sum over four ranks as a quarter of itself verifies."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

WORLD, HIDDEN, FFN, TOKENS = 4, 8, 16, 6


class Mlp(nn.Module):
    """fc1 column-parallel, fc2 row-parallel on ranks, each rank adding bias / world before
    the sum (DTensor's Replicate operand of an add with a Partial one)."""

    def __init__(self, ranks: bool = False) -> None:
        super().__init__()
        width = FFN // WORLD if ranks else FFN
        self.ranks = ranks
        self.fc1 = nn.Linear(HIDDEN, width)
        self.fc2 = nn.Linear(width, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if not self.ranks:
            return self.fc2(h)
        out = h @ self.fc2.weight.t() + self.fc2.bias / WORLD
        dist.all_reduce(out)
        return out


PLACEMENTS = {"fc1.weight": scalify.Shard(0), "fc1.bias": scalify.Shard(0),
              "fc2.weight": scalify.Shard(1)}


def _verify():
    torch.manual_seed(0)
    return scalify.verify_modules(
        reference=Mlp(), rank_module_factory=lambda rank: Mlp(ranks=True), world_size=WORLD,
        example_inputs={"x": torch.randn(TOKENS, HIDDEN)}, param_placements=PLACEMENTS,
        output_placements=[scalify.Replicate()], numeric=True)


def test_a_bias_shared_among_the_parts_of_a_partial_sum_verifies():
    report = _verify()
    assert report.verdict == "verified", report.discrepancies[:1]
    assert report.numeric["agrees"]
