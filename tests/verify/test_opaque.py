"""An op with no lowering never leads to "verified": what depends on it is unknown, the report
names it and its line, and the numeric cross-check declares the graphs not runnable."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import scalify
from scalify.cli import exit_code, numeric_agrees

HIDDEN, FFN, WORLD = 8, 16, 2


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN, opaque: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.opaque = opaque

    def forward(self, x):
        hidden = self.up(x)
        if self.opaque:
            hidden = torch.special.i0(hidden)  # no lowering, no decomposition into lowered ops
        return self.down(hidden)


class ParallelMLP(MLP):
    def forward(self, x):
        return funcol.all_reduce(super().forward(x), "sum", dist.group.WORLD)


def _verify(reference_opaque: bool, ranks_opaque: bool):
    with torch.device("meta"):
        reference = MLP(opaque=reference_opaque)
    return scalify.verify_modules(
        reference, lambda rank: ParallelMLP(FFN // WORLD, ranks_opaque).to("meta"), WORLD,
        {"x": torch.empty(2, 4, HIDDEN, device="meta")},
        {"up.weight": scalify.Shard(0), "down.weight": scalify.Shard(1)}, numeric=True)


def test_an_opaque_op_makes_the_verdict_unknown():
    report = _verify(True, True)
    assert report.verdict == "unknown" and not report.verified and exit_code(report) == 3
    assert any("bessel_i0 at" in reason and "test_opaque.py:24" in reason
               for reason in report.unknown)
    assert report.numeric["agrees"] is None and "bessel_i0" in report.numeric["skipped"]
    assert numeric_agrees(report)


def test_an_opaque_op_on_the_ranks_only_is_unknown_not_verified():
    report = _verify(False, True)
    assert not report.verified and report.verdict == "unknown"
