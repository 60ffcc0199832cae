"""The same math scaled at another place verifies: a data-parallel mean taken per rank, summed
over ranks and divided by the world size is the reference's mean over the whole batch; a
divisor that is wrong is still caught."""
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import scalify
from scalify.engine.inline import InlineExecutor

ROWS, HIDDEN, WORLD = 4, 8, 2


class MeanLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return torch.tanh(self.proj(x)).mean()


class DataParallelMeanLoss(MeanLoss):
    def __init__(self, divisor: int) -> None:
        super().__init__()
        self.divisor = divisor

    def forward(self, x):
        local = super().forward(x)
        return funcol.all_reduce(local, "sum", dist.group.WORLD) / self.divisor


@dataclass
class DeadlineAfterFirstAttempt(InlineExecutor):
    """Runs the first proof attempt as asked and any later one with its deadline passed."""

    attempts: int = 0

    def run(self, job, progress=lambda done, total: None):
        if self.attempts:
            job = replace(job, options=replace(job.options, deadline=0.0))
        self.attempts += 1
        return super().run(job, progress)


def _verify(divisor: int, executor=None):
    with torch.device("meta"):
        reference = MeanLoss()
    return scalify.verify_modules(
        reference=reference,
        rank_module_factory=lambda rank: DataParallelMeanLoss(divisor).to("meta"),
        world_size=WORLD, example_inputs={"x": torch.empty(ROWS, HIDDEN, device="meta")},
        input_placements={"x": scalify.Shard(0)}, output_placements=[scalify.Replicate()],
        numeric=True, executor=executor)


def test_a_mean_per_rank_averaged_over_ranks_is_the_global_mean():
    report = _verify(divisor=WORLD)
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert report.stats["scalar_factors"] == "moved"


@pytest.mark.parametrize("divisor", [1, 4])
def test_a_wrong_divisor_is_caught_at_its_line(divisor):
    report = _verify(divisor=divisor)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    where = report.discrepancies[0].dist_source
    assert "/ self.divisor" in Path(where.file).read_text().splitlines()[where.line - 1]


def test_a_deadline_passed_while_factors_are_moved_is_unknown_not_a_discrepancy():
    report = _verify(divisor=WORLD, executor=DeadlineAfterFirstAttempt())
    assert report.verdict == "unknown" and report.numeric["agrees"]
    assert report.stats["scalar_factors"] == "moved"
    assert any("deadline" in reason for reason in report.unknown)
