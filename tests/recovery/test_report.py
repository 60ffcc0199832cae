"""The benchmark's summary table."""
import pytest

from scalify.recovery.harness import Failure, Trial
from scalify.recovery.report import markdown_table, summarize


def trial(strategy: str, rework: float, bound: float = 1.0) -> Trial:
    return Trial("mlr", strategy, Failure(3, 0), rework, 0.5, bound)


def test_summaries_compare_each_strategy_with_traditional():
    trials = [trial("traditional", 4.0), trial("traditional", 6.0),
              trial("partial", 0.5), trial("partial", 0.5, bound=float("inf"))]
    traditional, partial = summarize(trials)
    assert (traditional.rework, traditional.stderr) == (5.0, 1.0)
    assert partial.reduction == pytest.approx(0.9)
    rows = markdown_table([traditional, partial])
    assert rows[2] == "| mlr | traditional | 2 | 5.00 ± 1.00 |  | 1.00 | 0% | 0.5 |"
    assert rows[3] == "| mlr | partial | 2 | 0.50 ± 0.00 | 90% | none (c >= 1) | - | 0.5 |"
