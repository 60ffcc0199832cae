"""Scalify on the corpus: every case verified (correct) or caught at its `# BUG` line (buggy).

    python -m tests.corpus.verify_cases [CASE ...] [--json FILE] [--deadline S] [--jobs N]

Prints one line per case as it finishes, then the table per style and step: verified of the
correct cases, caught and localized of the buggy ones, crashes and unknowns, and every false
alarm with its cause. Exits 1 on a crash or on a buggy case reported verified.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import signal
import statistics
import sys
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import scalify
from scalify.errors import ScalifyError
from scalify.verify.session import WindowLimits
from scalify.verify.verifier import VerifyOptions

from .cases import Case, case_paths, load

# One window may saturate for this long before its op is unknown (the product's default is
# 600 s): a corpus run stays within CI's time, and an unknown is reported, never verified.
WINDOW_SECONDS = 60.0
# A case gets a process of its own with this much time and address space: a window whose
# e-graph outgrows them inside one egglog iteration (which cannot be interrupted) makes that
# case unknown instead of taking the whole run down.
CASE_MEMORY = 14 << 30
# The run's own deadline (--deadline), inside the case's time with room for one window and the
# numbers: what it found by then is reported (a bug caught before it stands), the rest unknown.
# (A training step that is proved only with its scalar factors moved runs two attempts:
# DeepSpeed-Ulysses' takes about 200 s alone on this 2-core machine.)
DEADLINE_SECONDS = 300.0
CASE_SECONDS_PAST_DEADLINE = 100.0


@dataclass(frozen=True)
class Outcome:
    """What Scalify said of one case."""

    name: str
    style: str
    step: str
    buggy: bool
    verdict: str          # verified, discrepancy, unknown, refused (a Scalify error) or crash
    localized: bool
    seconds: float
    detail: str = ""      # the first discrepancy, the unknown reason or the error
    named: int = 0        # lines of the case's file the first discrepancy names

    @property
    def as_expected(self) -> bool:
        return self.verdict == ("discrepancy" if self.buggy else "verified")


def run(case: Case, deadline_seconds: float = DEADLINE_SECONDS) -> Outcome:
    """Verify one case with the public API, within `deadline_seconds` of its start."""
    module = case.module
    start = time.perf_counter()
    verdict, localized, detail, named = "crash", False, "", 0
    assumed = case.example_ranges()
    try:
        report = scalify.verify_modules(
            reference=module.reference(), rank_module_factory=lambda rank: module.rank_module(
                rank, case.world_size),
            world_size=case.world_size, example_inputs=case.example_inputs(),
            param_placements=case.attr("PARAM_PLACEMENTS"), shard_fn=case.attr("shard"),
            input_placements=case.attr("INPUT_PLACEMENTS", {}),
            output_placements=list(module.OUTPUT_PLACEMENTS), numeric=True,
            grad=case.step == "training", name=case.name, assume=assumed,
            options=VerifyOptions(limits=WindowLimits(seconds=WINDOW_SECONDS),
                                  deadline=time.time() + deadline_seconds))
        verdict = report.verdict
        if report.discrepancies:
            first = report.discrepancies[0]
            line = case.bug_line()
            localized = line is not None and (str(case.path), line) in first.lines()
            named = sum(file == str(case.path) for file, _ in first.lines())
            detail = f"{first.ref_op} at {first.location}: {first.found}"
        elif report.unknown:
            detail = report.unknown[0]
        else:  # verified: the programs as written, or with their scalar factors moved
            stated = report.stats.get("assumed", {})
            detail = f"scalar factors {report.stats['scalar_factors']}" + "".join(
                f"; assuming {name} in {bounds}" for name, bounds in stated.items())
    except ScalifyError as error:
        verdict, detail = "refused", str(error).splitlines()[0]
    except Exception as error:  # a crash is what the corpus exists to find
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        traceback.print_exc()
    return Outcome(case.name, case.style, case.step, case.buggy, verdict, localized,
                   time.perf_counter() - start, detail, named)


def run_bounded(path: Path, deadline_seconds: float = DEADLINE_SECONDS) -> Outcome:
    """`run` in a child process within CASE_SECONDS_PAST_DEADLINE of its deadline and within
    CASE_MEMORY; past them, unknown. The
    children fork from a server that has imported Scalify but never run egglog (a fork of a
    process whose egglog thread pool runs would wait on threads it does not have)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    case = load(path)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_run_and_send, args=(path, send, deadline_seconds))
    case_seconds = deadline_seconds + CASE_SECONDS_PAST_DEADLINE
    start = time.perf_counter()
    child.start()
    send.close()
    if receive.poll(case_seconds):
        try:
            outcome = receive.recv()
            child.join()
            return outcome
        except EOFError:  # the child died before it answered
            pass
    child.kill()
    child.join()
    reason = (f"no verdict within {case_seconds:g} s" if child.exitcode == -signal.SIGKILL
              else f"the verifier ran out of its {CASE_MEMORY >> 30} GiB (exit {child.exitcode})")
    return Outcome(case.name, case.style, case.step, case.buggy, "unknown", False,
                   time.perf_counter() - start, f"{reason}: a window's e-graph kept growing")


def _run_and_send(path: Path, send: Any, deadline_seconds: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CASE_MEMORY, CASE_MEMORY))
    send.send(run(load(path), deadline_seconds))


def table(outcomes: list[Outcome]) -> str:
    """Per style and step: verified/correct, caught/bugs, localized/bugs, refusals (a one-line
    Scalify error), crashes, unknowns."""
    rows: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        rows[(outcome.style, outcome.step)].append(outcome)
        rows[("all", "")].append(outcome)
    lines = ["| style | step | verified / correct | caught / bugs | localized / bugs | refused "
             "| crashes | unknown |", "|---|---|---|---|---|---|---|---|"]
    for (style, step), group in sorted(rows.items(), key=lambda item: item[0][0] == "all"):
        correct = [o for o in group if not o.buggy]
        bugs = [o for o in group if o.buggy]
        caught = [o for o in bugs if o.verdict == "discrepancy"]
        lines.append(
            f"| {style} | {step} | {sum(o.verdict == 'verified' for o in correct)} / {len(correct)} "
            f"| {len(caught)} / {len(bugs)} | {sum(o.localized for o in caught)} / {len(bugs)} "
            f"| {sum(o.verdict == 'refused' for o in group)} "
            f"| {sum(o.verdict == 'crash' for o in group)} "
            f"| {sum(o.verdict == 'unknown' for o in group)} |")
    return "\n".join(lines)


def _run_and_print(path: Path, deadline_seconds: float) -> Outcome:
    """`run_bounded`, its line printed as it finishes."""
    outcome = run_bounded(path, deadline_seconds)
    mark = "ok  " if outcome.as_expected else "MISS"
    where = f" (at the bug's line, one of {outcome.named} named)" if outcome.localized else ""
    print(f"{mark} {outcome.name} [{outcome.step}, {'bug' if outcome.buggy else 'correct'}]: "
          f"{outcome.verdict}{where} in {outcome.seconds:.1f} s {outcome.detail}", flush=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="cases (style/name or part of it); default all")
    parser.add_argument("--json", help="also write the outcomes to this file")
    parser.add_argument("--deadline", type=float, default=DEADLINE_SECONDS, metavar="SECONDS",
                        help="each case's proof deadline (default %(default)g): past it, what "
                        "is not proved is unknown")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="cases verified at once, each in its own process (default "
                        "%(default)s; one a core: a proof runs on one)")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        outcomes = list(pool.map(lambda path: _run_and_print(path, args.deadline),
                                 case_paths(args.cases)))
    print(table(outcomes))
    named = sorted(o.named for o in outcomes if o.buggy and o.verdict == "discrepancy")
    if named:  # how narrow "at the bug's line" is
        print(f"lines of its case's file a caught bug's report names: median "
              f"{statistics.median(named):g}, at most {named[-1]}")
    misses = [o for o in outcomes if not o.as_expected]
    for outcome in misses:
        print(f"- {outcome.name}: {outcome.verdict}: {outcome.detail}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    unsound = [o for o in outcomes if o.buggy and o.verdict == "verified"]
    return 1 if unsound or any(o.verdict == "crash" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
