"""Code that agrees with the reference only on the inputs callers pass: PyTorch's cross-entropy
skips targets equal to its ignore index, a hand-written loss counts them all. With the labels
assumed in range the two are one program, and the report says what was assumed; a wrong
divisor is still caught under the same assumption."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify
from scalify.errors import ScalifyError

ROWS, HIDDEN, CLASSES, WORLD = 4, 8, 6, 2


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, CLASSES, bias=False)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(x), labels)


class DataParallelClassifier(Classifier):
    """Each rank's mean of its per-target losses (ignored targets counted), averaged over
    ranks."""

    def __init__(self, divisor: int) -> None:
        super().__init__()
        self.divisor = divisor

    def forward(self, x, labels):
        local = F.cross_entropy(self.head(x), labels, reduction="none").mean()
        return funcol.all_reduce(local, "sum", dist.group.WORLD) / self.divisor


def _verify(divisor: int, assume: dict | None):
    with torch.device("meta"):
        reference = Classifier()
    return scalify.verify_modules(
        reference=reference,
        rank_module_factory=lambda rank: DataParallelClassifier(divisor).to("meta"),
        world_size=WORLD, example_inputs={
            "x": torch.empty(ROWS, HIDDEN, device="meta"),
            "labels": torch.empty(ROWS, dtype=torch.long, device="meta")},
        input_placements={"x": scalify.Shard(0), "labels": scalify.Shard(0)},
        output_placements=[scalify.Replicate()], numeric=True, assume=assume)


def test_ignored_targets_are_a_true_difference_without_the_assumption():
    assert _verify(divisor=WORLD, assume=None).verdict == "discrepancy"


def test_labels_assumed_in_range_verify_and_the_report_says_so():
    report = _verify(divisor=WORLD, assume={"labels": (0, CLASSES - 1)})
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert report.stats["assumed"] == {"labels": f"[0, {CLASSES - 1}]"}


def test_a_wrong_divisor_is_caught_under_the_assumption():
    report = _verify(divisor=1, assume={"labels": (0, CLASSES - 1)})
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    where = report.discrepancies[0].dist_source
    line = Path(where.file).read_text().splitlines()[where.line - 1]
    # (at one of the two lines that scale the rank's loss: which one is reported depends on
    # what the process proved before, see the stop's note; test_scaled_elsewhere pins the line)
    assert "/ self.divisor" in line or ".mean()" in line


def test_an_empty_range_is_refused():
    with pytest.raises(ScalifyError, match="low <= high"):
        _verify(divisor=WORLD, assume={"labels": (3, 1)})


@pytest.mark.parametrize("name, what", [("x", "a float32 input"), ("label", "not an input")])
def test_a_range_of_anything_but_an_integer_input_is_refused(name, what):
    with pytest.raises(ScalifyError, match=f"assume.{name}: .*{what}"):
        _verify(divisor=WORLD, assume={name: (0, 1)})
