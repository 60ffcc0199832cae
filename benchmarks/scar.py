"""SCAR rework-cost benchmark: for each workload, random failures that lose one server shard of
n, recovered by each strategy; the mean extra iterations to the reference's loss threshold,
beside the bound for linear convergence. One end-to-end run on the Ray parameter server kills a
shard actor and checks the in-process figure. Writes its section of RESULTS.md."""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from results import RESULTS, write_section
from scalify.engine.cluster import LOCAL_TEMP_DIR
from scalify.recovery.harness import Failure, random_failures, reference_run, run_trials
from scalify.recovery.layout import Layout
from scalify.recovery.report import markdown_table, summarize
from scalify.recovery.server import ParameterServer
from scalify.recovery.strategies import strategies
from scalify.recovery.tracking import log_trials
from scalify.recovery.workloads import WORKLOADS, LogisticRegression

BLOCKS, SHARDS, PERIOD, FRACTION = 32, 8, 8, 0.25


@dataclass(frozen=True)
class Setup:
    """The reference's threshold is its loss at `target`; `horizon` iterations stand in for the
    optimum when fitting the linear rate."""

    target: int
    horizon: int


FULL = {"mlr": Setup(100, 250), "mf": Setup(30, 80), "lda": Setup(60, 150)}
QUICK = {"mlr": Setup(30, 60), "mf": Setup(10, 25), "lda": Setup(20, 40)}
RAY_FAILURE = Failure(45, lost_shard=3)


def rework_rows(setups: dict[str, Setup], failures: int, folder: Path,
                tracking_uri: str | None) -> tuple[list[str], list[str]]:
    """The rework table, and one line per workload on its reference run."""
    trials, notes = [], []
    for name, setup in setups.items():
        start = time.perf_counter()
        workload = WORKLOADS[name]()
        reference = reference_run(workload, setup.target, setup.horizon)
        layout = Layout(workload.size, BLOCKS, SHARDS)
        drawn = random_failures(reference, SHARDS, failures, seed=0)
        trials += run_trials(workload, reference, layout, strategies(PERIOD, FRACTION), drawn,
                             folder / name)
        notes.append(f"- {name}: {workload.size:,} parameters; threshold {reference.threshold:.4f}"
                     f" (the loss at iteration {setup.target}); measured linear rate c = "
                     f"{reference.rate:.4f}; {time.perf_counter() - start:.0f} s.")
        print(notes[-1], flush=True)
    if tracking_uri:
        log_trials(trials, tracking_uri)
    return markdown_table(summarize(trials)), notes


def ray_rows(folder: Path) -> list[str]:
    """MLR on the Ray parameter server with a shard actor killed, against the harness."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(LOCAL_TEMP_DIR))
    workload = LogisticRegression()
    reference = reference_run(workload, FULL["mlr"].target, FULL["mlr"].target)
    layout = Layout(workload.size, BLOCKS, SHARDS)
    rows = ["| strategy | rework on Ray (iterations) | in-process harness | shard restarts |",
            "|---|---|---|---|"]
    for strategy in (strategies(PERIOD, FRACTION)[0], strategies(PERIOD, FRACTION)[2]):
        server = ParameterServer(LogisticRegression, layout, strategy, folder / strategy.name)
        try:
            reached = server.train(reference.threshold, 3 * FULL["mlr"].target, RAY_FAILURE)
        finally:
            server.close()
        [trial] = run_trials(workload, reference, layout, [strategy], [RAY_FAILURE],
                             folder / f"{strategy.name}-numpy")
        rows.append(f"| {strategy.name} | {reached - reference.reached:.2f} | {trial.rework:.2f} "
                    f"| {len(server.restarts)} |")
        print(rows[-1], flush=True)
    ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs, 4 failures, no Ray")
    parser.add_argument("--failures", type=int, default=20, help="failures per workload")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--tracking-uri", help="log every trial to this MLflow store")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        table, notes = rework_rows(QUICK if args.quick else FULL,
                                   4 if args.quick else args.failures, Path(folder),
                                   args.tracking_uri)
        end_to_end = [] if args.quick else ray_rows(Path(folder))
    lines = [
        "## Fault tolerance (SCAR)", "",
        f"Machine: {platform.machine()}, {platform.python_version()}, 2 cores. Command: "
        f"`make bench-scar`{' --quick' if args.quick else ''} "
        f"({time.perf_counter() - start:.0f} s).", "",
        f"Each failure loses one parameter-server shard of {SHARDS} ({BLOCKS} blocks, dealt "
        "round-robin) at an iteration drawn before the reference reaches its threshold, and "
        "every strategy recovers the same failures. Traditional and partial save all blocks "
        f"every {PERIOD} iterations; prioritized, round-robin and random save {FRACTION:.0%} of "
        f"the blocks every {round(FRACTION * PERIOD)} (the same I/O). Rework cost: extra "
        "iterations to the threshold, the loss interpolated between iterations; mean ± "
        "standard error. Bound: log_1/c(1 + c^-T ||delta|| / ||x_0 - x*||), with c the "
        "linear rate that envelopes the reference's distances to its last iterate.", "",
        *table, "", *notes]
    if end_to_end:
        lines += ["", f"End to end on Ray (MLR, shard {RAY_FAILURE.lost_shard} killed with "
                  f"`ray.kill(actor, no_restart=False)` after iteration {RAY_FAILURE.iteration}, "
                  "restarted by Ray, recovered from the checkpoint store):", "", *end_to_end]
    write_section("scar", "\n".join(lines), args.results)
    print("\n".join(table))


if __name__ == "__main__":
    main()
