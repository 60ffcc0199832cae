"""The parallelism matrix: model family x parallel plan x forward/backward.

Every correct cell must verify and every planted-bug cell must be caught at its planted line,
with the numeric cross-check agreeing on each verdict. `python -m scalify.matrix [--jobs N]`
(or `make matrix`, which CI runs) runs every cell and prints the table.
"""
from __future__ import annotations

import argparse
import multiprocessing
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

import scalify

_PLANTED_FILES = ("parallel/planted.py", "parallel/dtensor_planted.py",
                  "parallel/experts_planted.py", "parallel/context_planted.py")
_HINTED = re.compile(r"(/[^\s:,]+\.py):(\d+)")  # file:line in a hint
_LAYERS = {"llama": "model.num_hidden_layers", "gpt2": "model.n_layer",
           "mixtral": "model.num_hidden_layers"}


@dataclass(frozen=True)
class Cell:
    """One configuration: a tiny model of `family`, a plan, forward or one training step."""

    family: str
    plan: str  # the column label
    backward: bool
    plan_fields: tuple[tuple[str, object], ...] = ()
    bug: str | None = None
    batch: int = 1
    rank_symmetry: bool = True
    loss: bool = False  # forward up to the loss
    layers: int = 1  # decoder layers of the tiny model
    model_fields: tuple[tuple[str, object], ...] = ()  # config overrides, e.g. fewer kv heads

    @property
    def step(self) -> str:
        return "backward" if self.backward else "loss" if self.loss else "forward"

    @property
    def name(self) -> str:
        step = self.step
        kind = f"bug {self.bug}" if self.bug else "per-rank" if not self.rank_symmetry else "correct"
        return f"{self.family}/{self.plan}/{step}/{kind}"

    def world_size(self) -> int:
        fields = dict(self.plan_fields)
        return (int(fields.get("tensor_parallel", 1)) * int(fields.get("data_parallel", 1))
                * int(fields.get("expert_parallel", 1)) * int(fields.get("pipeline_parallel", 1))
                * int(fields.get("context_parallel", 1)))

    def experiment(self) -> dict:
        world = self.world_size()
        return {"name": self.name, "model": f"{self.family}-tiny",
                "plan": {"tensor_parallel": 1, **dict(self.plan_fields), "planted_bug": self.bug},
                "hardware": {"name": f"gpu-{world}", "target": "gpu", "devices": world},
                "inputs": {"batch": self.batch, "seq": 8},
                "overrides": {_LAYERS[self.family]: self.layers,
                              **{f"model.{key}": value for key, value in self.model_fields}},
                "verify": {"backward": self.backward, "loss": self.loss,
                           "rank_symmetry": self.rank_symmetry}}


def _cells() -> list[Cell]:
    tp2 = (("tensor_parallel", 2),)
    sp2 = (("tensor_parallel", 2), ("sequence_parallel", True))
    dp2 = (("data_parallel", 2),)
    zero2 = (("data_parallel", 2), ("zero_stage", 2))
    micro = (("data_parallel", 2), ("micro_batches", 2))
    hf = (("style", "dtensor"), ("tensor_parallel", 2), ("dtensor_plan", "hf"))
    vocab2 = (("tensor_parallel", 2), ("logits", "vocab_parallel"))
    vocab4 = (("tensor_parallel", 4), ("logits", "vocab_parallel"))
    ce_bugs = ("ce-target-mask-off-by-one", "ce-max-not-allreduced", "ce-sum-not-allreduced",
               "ce-loss-scaled-by-tp")
    ep2 = (("expert_parallel", 2),)
    a2a = (("expert_parallel", 2), ("expert_dispatch", "all_to_all"))
    pp2 = (("pipeline_parallel", 2),)
    pp2_micro = (("pipeline_parallel", 2), ("micro_batches", 2))
    cp2 = (("context_parallel", 2),)
    fused2 = (("tensor_parallel", 2), ("fused", True))
    kv2 = (("num_key_value_heads", 2),)  # one [q, k, v] group per rank
    cp2_balanced = (("context_parallel", 2), ("context_load_balance", True))
    return [
        Cell("llama", "TP2", False, tp2),
        Cell("gpt2", "TP2", False, tp2),
        Cell("llama", "TP2+SP", False, sp2),
        Cell("llama", "DP2", False, dp2, batch=2),
        Cell("llama", "DTensor hf TP2", False, hf),
        Cell("mixtral", "EP2", False, ep2),
        Cell("mixtral", "EP2", False, ep2, rank_symmetry=False),
        Cell("mixtral", "EP2 all-to-all", False, a2a),
        Cell("mixtral", "EP2", True, ep2),
        Cell("llama", "TP2", True, tp2),
        Cell("llama", "TP2", True, tp2, rank_symmetry=False),
        Cell("llama", "TP2+SP", True, sp2),
        Cell("llama", "DP2", True, dp2, batch=2),
        Cell("llama", "DP2 ZeRO-2", True, zero2, batch=2),
        Cell("llama", "DTensor hf TP2", True, hf),
        Cell("llama", "TP2", True, tp2, bug="missing-allreduce"),
        Cell("gpt2", "TP2", False, tp2, bug="global-heads-reshape"),
        Cell("llama", "TP2+SP", True, sp2, bug="sp-norm-grad-unreduced"),
        Cell("llama", "TP2+SP", True, sp2, bug="sp-gather-grad-not-reduced"),
        Cell("llama", "TP2+SP", True, sp2, bug="sp-reduce-scatter-as-allreduce"),
        Cell("llama", "TP2+SP", False, sp2, bug="sp-norm-wrong-shard"),
        Cell("llama", "DP2", True, dp2, bug="dp-mean-of-means", batch=2),
        Cell("llama", "DP2", True, dp2, bug="dp-grads-averaged", batch=2),
        Cell("llama", "DTensor hf TP2", False, hf, bug="dtensor-global-heads-reshape"),
        Cell("llama", "TP2 vocab-parallel loss", False, vocab2, loss=True),
        Cell("llama", "TP4 vocab-parallel loss", False, vocab4, loss=True),
        *(Cell("llama", "TP2 vocab-parallel loss", False, vocab2, bug=bug, loss=True)
          for bug in ce_bugs),
        Cell("llama", "TP2 vocab-parallel loss", True, vocab2),
        Cell("llama", "TP4 vocab-parallel loss", True, vocab4),
        Cell("llama", "TP2 vocab-parallel loss", True, vocab2, bug="ce-sum-grad-allreduced"),
        Cell("gpt2", "TP2", True, tp2),
        Cell("gpt2", "TP2", True, tp2, rank_symmetry=False),
        Cell("llama", "DP2 x2 micro-batches", True, micro, batch=4),
        Cell("llama", "DP2 x2 micro-batches", True, micro, batch=4, rank_symmetry=False),
        Cell("llama", "DP2 x2 micro-batches", True, micro, bug="dp-last-microbatch-unsynced",
             batch=4),
        Cell("mixtral", "EP2", False, ep2, bug="ep-combine-weights-twice"),
        Cell("mixtral", "EP2", False, ep2, bug="ep-topk-local-experts"),
        Cell("mixtral", "EP2 all-to-all", False, a2a, bug="ep-wrong-split-sizes"),
        Cell("mixtral", "EP2 all-to-all", True, a2a),
        Cell("mixtral", "EP2 all-to-all", True, a2a, bug="ep-a2a-token-grad-unreduced"),
        Cell("llama", "PP2", False, pp2, layers=2),
        Cell("llama", "PP2 x2 micro-batches", False, pp2_micro, batch=2, layers=2),
        Cell("llama", "PP2 x2 micro-batches", True, pp2_micro, batch=2, layers=2),
        Cell("llama", "PP2", False, pp2, bug="pp-stage-boundary-duplicated", layers=2),
        Cell("llama", "PP2 x2 micro-batches", True, pp2_micro,
             bug="pp-loss-normalised-per-microbatch", batch=2, layers=2),
        Cell("llama", "CP2", False, cp2),
        Cell("llama", "CP2", False, cp2, bug="cp-local-softmax-no-merge"),
        Cell("llama", "CP2", False, cp2, bug="cp-mask-local-positions"),
        Cell("llama", "TP2 fused, 2 kv heads", True, fused2, model_fields=kv2),
        Cell("llama", "TP2 fused, 2 kv heads", True, fused2, model_fields=kv2,
             bug="fused-plain-column-shard"),
        Cell("llama", "CP2 load-balanced", False, cp2_balanced),
        Cell("llama", "CP2 load-balanced", False, cp2_balanced, bug="cp-mask-local-positions"),
    ]


CELLS = _cells()
# Cells of minutes each, and the per-rank twins of training cells whose symmetric path is in
# the matrix (the per-rank path stays in it through the EP2 forward cell and
# tests/verify/test_correct_configs.py): `--skip-slow` (as CI runs it) leaves them out.
SLOW = frozenset({"llama/TP2 fused, 2 kv heads/backward/correct",
                  "llama/TP2 fused, 2 kv heads/backward/bug fused-plain-column-shard",
                  "llama/TP2/backward/per-rank", "gpt2/TP2/backward/per-rank",
                  "llama/DP2 x2 micro-batches/backward/per-rank"})


def planted_line(bug: str) -> tuple[str, int]:
    """The file and line marked `# planted: <bug>`."""
    package = Path(scalify.__file__).parent
    for relative in _PLANTED_FILES:
        path = package / relative
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if text.rstrip().endswith(f"# planted: {bug}"):
                return str(path), number
    raise KeyError(f"no line is marked '# planted: {bug}'")


@dataclass
class Outcome:
    """What running a cell gave, and whether that is what the cell expects."""

    verdict: str
    agrees: bool
    at_planted_line: bool | None
    seconds: float
    passed: bool
    where: str = ""


def run_cell(cell: Cell) -> Outcome:
    """Verify the cell with the numeric cross-check and judge the result."""
    start = time.perf_counter()
    report = scalify.verify(cell.experiment(), numeric=True)
    return judged(report, time.perf_counter() - start,
                  (lambda file, line: (file, line) == planted_line(cell.bug)) if cell.bug else None)


def judged(report: scalify.Report, seconds: float,
           at_bug: Callable[[str, int], bool] | None) -> Outcome:
    """A correct cell (`at_bug` None) passes verified with the numbers agreeing; a bug cell
    caught, the numbers differing, with a line `at_bug` accepts among the lines its first
    discrepancy names, or in its hint (a sharding function's line, where the layout a fused
    bug gets wrong was stated)."""
    agrees = bool(report.numeric and report.numeric["agrees"])
    first = report.discrepancies[0] if report.discrepancies else None
    where = str(first.dist_source) if first else ""
    if at_bug is None:
        return Outcome(report.verdict, agrees, None, seconds,
                       report.verdict == "verified" and agrees, where)
    named = list(first.lines()) + [(file, int(line)) for file, line in
                                   _HINTED.findall(first.hint)] if first else []
    at_line = any(at_bug(file, line) for file, line in named)
    passed = report.verdict == "discrepancy" and not agrees and at_line
    return Outcome(report.verdict, agrees, at_line, seconds, passed, where)


def _row(cell: Cell, outcome: Outcome) -> list[str]:
    expected = "caught at its line" if cell.bug else "verified"
    found = outcome.verdict + (" at the planted line" if outcome.at_planted_line else "")
    numbers = "agree" if outcome.agrees else "differ"
    mark = "[green]pass[/]" if outcome.passed else "[red]FAIL[/]"
    kind = cell.bug or ("correct, per-rank" if not cell.rank_symmetry else "correct")
    return [cell.family, cell.plan, cell.step, kind, expected,
            found, numbers, f"{outcome.seconds:.1f}", mark]


def run_all(cells: list, run: Callable[[Any], Outcome], jobs: int) -> dict[Any, Outcome]:
    """Every cell's outcome, `jobs` cells at once (each in a process of its own), a line
    printed as each finishes. A cell whose run raises is a failed `crash` (its error as where),
    and the other cells still run."""
    outcomes: dict[Any, Outcome] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {pool.submit(run, cell): cell for cell in cells}
        for done in as_completed(running):
            cell = running[done]
            try:
                outcomes[cell] = done.result()
            except Exception as error:  # noqa: BLE001 (any error of the cell's run)
                outcomes[cell] = Outcome("crash", False, None, 0.0, False,
                                         f"{type(error).__name__}: {error}")
            print(f"[{len(outcomes)}/{len(cells)}] {cell.name}: {outcomes[cell].verdict} "
                  f"({outcomes[cell].seconds:.0f} s)", flush=True)
    return outcomes


def print_table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


def arguments(argv: list[str] | None, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--jobs", type=int, default=1, help="cells verified at once")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments(argv, __doc__.splitlines()[0])
    parser.add_argument("--skip-slow", action="store_true", help="leave out the SLOW cells")
    args = parser.parse_args(argv)
    cells = [cell for cell in CELLS if not (args.skip_slow and cell.name in SLOW)]
    outcomes = run_all(cells, run_cell, args.jobs)
    print_table("Scalify parallelism matrix (tiny models, numeric cross-check on)",
                ("family", "plan", "step", "cell", "expected", "verdict", "numbers", "s", ""),
                [_row(cell, outcomes[cell]) for cell in cells])
    return 0 if all(outcome.passed for outcome in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
