"""Users bring their own modules: a Megatron MLP written with functional collectives."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify

HIDDEN, FFN, WORLD = 8, 16, 2


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ParallelMLP(MLP):
    def __init__(self, reduce: bool = True) -> None:
        super().__init__(FFN // WORLD)
        self.reduce = reduce

    def forward(self, x):
        partial = super().forward(x)
        return funcol.all_reduce(partial, "sum", dist.group.WORLD) if self.reduce else partial


def _verify(reduce: bool):
    with torch.device("meta"):
        reference = MLP()
    return scalify.verify_modules(
        reference=reference,
        rank_module_factory=lambda rank: ParallelMLP(reduce).to("meta"),
        world_size=WORLD, example_inputs={"x": torch.empty(2, 4, HIDDEN, device="meta")},
        param_placements={"up.weight": scalify.Shard(0), "down.weight": scalify.Shard(1)},
        output_placements=[scalify.Replicate()], numeric=True)


def test_user_mlp_verifies():
    report = _verify(reduce=True)
    assert report.verified and report.numeric["agrees"]


def test_user_mlp_without_all_reduce_is_a_partial_sum():
    report = _verify(reduce=False)
    assert not report.verified and not report.numeric["agrees"]
    assert "Partial(sum)" in report.discrepancies[0].found
