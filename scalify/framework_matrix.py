"""The framework matrix: the real Megatron-Core and torchtitan x plan x forward, loss or
training step, each cell an experiment under configs/experiments/.

A correct cell must verify with the numbers agreeing; a bug cell (a fault patched into the
framework at capture, or one the release has) must be caught with the numbers differing, its
first discrepancy naming the bug's line. `python -m scalify.framework_matrix [--jobs N]` (or
`make frameworks`, which CI runs) verifies every cell and prints the table.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

import scalify
from scalify.config import REPO_CONFIGS
from scalify.matrix import Outcome, judged


@dataclass(frozen=True)
class FrameworkCell:
    """One experiment of `framework`: `config` names configs/experiments/<config>.yaml. A bug
    cell says what the bug is (`bug`) and where its report must point: a line (`line`) of the
    file whose path ends with `file`."""

    framework: str
    plan: str
    step: str  # forward, loss or training step
    config: str
    bug: str | None = None
    file: str = ""
    line: int = 0

    @property
    def name(self) -> str:
        return f"{self.framework}/{self.plan}/{self.step}/{self.bug or 'correct'}"

    def at_bug(self, file: str, line: int) -> bool:
        return file.endswith(self.file) and line == self.line


_MC, _TT = "megatron_core", "torchtitan"
_TT_LOSS = "torchtitan/components/loss.py"

CELLS = [
    FrameworkCell(_MC, "TP2", "forward", "megatron-core-llama-tiny-tp2"),
    FrameworkCell(_MC, "TP2, 2 kv heads", "forward", "megatron-core-llama-tiny-gqa-tp2"),
    FrameworkCell(_MC, "TP4", "forward", "megatron-core-llama-tiny-tp4"),
    FrameworkCell(_MC, "TP2", "loss", "megatron-core-llama-tiny-loss-tp2"),
    FrameworkCell(_MC, "TP2", "forward", "megatron-core-bug-head-size-from-rank-share",
                  "planted: head size from the rank's share (TransformerEngine#777's kind)",
                  "megatron/core/transformer/dot_product_attention.py", 85),
    FrameworkCell(_MC, "TP2", "loss", "megatron-core-bug-gathered-logits-loss",
                  "planted: gathered logits into the vocab-parallel loss (Megatron-LM#7452)",
                  "megatron/core/tensor_parallel/mappings.py", 94),
    FrameworkCell(_TT, "TP2+SP", "forward", "torchtitan-llama-tiny-tp2"),
    FrameworkCell(_TT, "TP2", "forward", "torchtitan-llama-tiny-tp2-no-sp"),
    FrameworkCell(_TT, "TP2, 2 kv heads", "forward", "torchtitan-llama-tiny-gqa-tp2"),
    FrameworkCell(_TT, "TP2, 2 kv heads, spmd_types", "forward",
                  "torchtitan-llama-tiny-gqa-tp2-spmd-types"),
    FrameworkCell(_TT, "TP2+SP", "loss", "torchtitan-llama-tiny-loss-tp2"),
    FrameworkCell(_TT, "TP2+SP", "training step", "torchtitan-llama-tiny-step-tp2"),
    FrameworkCell(_TT, "TP2, spmd_types", "training step",
                  "torchtitan-llama-tiny-step-tp2-spmd-types"),
    FrameworkCell(_TT, "TP2, attention bias, spmd_types", "training step",
                  "torchtitan-bug-scaled-row-bias-gradient",
                  "as released: row-parallel bias gradient divided by tp (torchtitan#4332)",
                  "torchtitan/models/common/linear.py", 70),
    FrameworkCell(_TT, "TP2, attention bias, spmd_types, #4332's fix patched in",
                  "training step", "torchtitan-fix-scaled-row-bias-gradient"),
    FrameworkCell(_TT, "TP2+SP", "training step",
                  "torchtitan-bug-loss-parallel-backward-without-softmax",
                  "planted: loss-parallel backward without its softmax term (pytorch#190746's kind)",
                  _TT_LOSS, 219),
    FrameworkCell(_TT, "TP2+SP", "training step",
                  "torchtitan-bug-loss-parallel-backward-ignored-labels",
                  "planted: ignore mask read from the sanitized labels", _TT_LOSS, 216),
]


def run_cell(cell: FrameworkCell) -> Outcome:
    """Verify the cell's experiment (its config turns the numeric cross-check on) and judge."""
    start = time.perf_counter()
    report = scalify.verify(REPO_CONFIGS / "experiments" / f"{cell.config}.yaml", numeric=True)
    return judged(report, time.perf_counter() - start, cell.at_bug if cell.bug else None)


def _row(cell: FrameworkCell, outcome: Outcome) -> list[str]:
    expected = f"caught at {cell.file.rsplit('/', 1)[-1]}:{cell.line}" if cell.bug else "verified"
    found = outcome.verdict + (" at the bug's line" if outcome.at_planted_line else "")
    mark = "[green]pass[/]" if outcome.passed else "[red]FAIL[/]"
    return [cell.framework, cell.plan, cell.step, cell.bug or "correct", expected, found,
            "agree" if outcome.agrees else "differ", f"{outcome.seconds:.1f}", mark]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="cells verified at once")
    jobs = parser.parse_args(argv).jobs
    outcomes: dict[FrameworkCell, Outcome] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {pool.submit(run_cell, cell): cell for cell in CELLS}
        for done in as_completed(running):
            cell = running[done]
            outcomes[cell] = done.result()
            print(f"[{len(outcomes)}/{len(CELLS)}] {cell.name}: {outcomes[cell].verdict} "
                  f"({outcomes[cell].seconds:.0f} s)", flush=True)
    table = Table(title="Scalify framework matrix (real Megatron-Core and torchtitan, "
                        "numeric cross-check on)")
    for column in ("framework", "plan", "step", "cell", "expected", "verdict", "numbers", "s", ""):
        table.add_column(column)
    for cell in CELLS:
        table.add_row(*_row(cell, outcomes[cell]))
    Console(width=200).print(table)
    return 0 if all(outcome.passed for outcome in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
