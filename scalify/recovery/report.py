"""Summaries of rework-cost trials, as a Markdown table for benchmarks/RESULTS.md."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .harness import Trial

@dataclass(frozen=True)
class Summary:
    """One strategy on one workload, over its failures: mean rework cost (and its standard
    error), the reduction against traditional recovery, the mean bound, the share of failures
    whose cost the bound covered, and the mean perturbation."""

    workload: str
    strategy: str
    trials: int
    rework: float
    stderr: float
    reduction: float
    bound: float
    held: float
    perturbation: float


def summarize(trials: list[Trial]) -> list[Summary]:
    """Per workload and strategy, in the order the trials came."""
    groups: dict[tuple[str, str], list[Trial]] = {}
    for trial in trials:
        groups.setdefault((trial.workload, trial.strategy), []).append(trial)
    summaries = []
    for (workload, strategy), group in groups.items():
        rework = np.array([t.rework for t in group])
        baseline = np.mean([t.rework for t in groups[(workload, "traditional")]])
        summaries.append(Summary(
            workload, strategy, len(group), float(rework.mean()),
            float(rework.std(ddof=1) / math.sqrt(len(group))) if len(group) > 1 else 0.0,
            float(1.0 - rework.mean() / baseline), float(np.mean([t.bound for t in group])),
            float(np.mean([t.rework <= t.bound for t in group])),
            float(np.mean([t.perturbation for t in group]))))
    return summaries


def markdown_table(summaries: list[Summary]) -> list[str]:
    rows = ["| workload | strategy | failures | rework cost (iterations) | reduction vs "
            "traditional | bound (iterations) | bound held | perturbation norm |",
            "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        bound, held = ((f"{s.bound:.2f}", f"{100 * s.held:.0f}%") if math.isfinite(s.bound)
                       else ("none (c >= 1)", "-"))
        reduction = "" if s.strategy == "traditional" else f"{100 * s.reduction:.0f}%"
        rows.append(f"| {s.workload} | {s.strategy} | {s.trials} | {s.rework:.2f} ± "
                    f"{s.stderr:.2f} | {reduction} | {bound} | {held} | "
                    f"{s.perturbation:.3g} |")
    return rows
