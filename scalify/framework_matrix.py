"""The framework matrix: the real Megatron-Core and torchtitan x plan x forward, loss or
training step, each cell an experiment under configs/experiments/.

A correct cell must verify with the numbers agreeing; a bug cell (a fault patched into the
framework at capture, or one the release has) must be caught with the numbers differing, its
first discrepancy naming the bug's line. `python -m scalify.framework_matrix [--jobs N]` (or
`make frameworks`, which CI runs) verifies every cell and prints the table.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import scalify
from scalify.config import REPO_CONFIGS
from scalify.matrix import Outcome, arguments, judged, print_table, run_all


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
    FrameworkCell(_MC, "TP2, label smoothing", "loss", "megatron-core-bug-label-smoothing-loss",
                  "as released: label smoothing over each rank's shard (Megatron-LM#737)",
                  "megatron/core/tensor_parallel/cross_entropy.py", 176),
    FrameworkCell(_MC, "TP2, label smoothing, a fix patched in", "loss",
                  "megatron-core-fix-label-smoothing-loss"),
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
    outcomes = run_all(CELLS, run_cell, arguments(argv, __doc__.splitlines()[0]).parse_args(argv).jobs)
    print_table("Scalify framework matrix (real Megatron-Core and torchtitan, numeric "
                "cross-check on)",
                ("framework", "plan", "step", "cell", "expected", "verdict", "numbers", "s", ""),
                [_row(cell, outcomes[cell]) for cell in CELLS])
    return 0 if all(outcome.passed for outcome in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
