"""Command line: `scalify verify CONFIG [--json FILE] [--html FILE] [--numeric]`,
`scalify sweep SWEEP [--out DIR]` and `scalify mutate CONFIG [--budget N] [--seed S] [--json FILE]`.

Exit codes: 0 verified, 1 discrepancy (or a numeric cross-check that disagrees, or a mutant
that changes the numbers and still verifies), 2 bad input.
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from .errors import ScalifyError
from .report.model import Report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalify", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="verify an experiment config")
    verify.add_argument("config", help="experiment YAML file")
    verify.add_argument("--json", help="write the JSON report here")
    verify.add_argument("--html", help="write the HTML report here")
    verify.add_argument("--numeric", action="store_true",
                        help="also run the captured graphs on random inputs and compare")
    sweep = commands.add_parser("sweep", help="verify every point of a grid and plot the cost")
    sweep.add_argument("config", help="sweep YAML file (an experiment plus `grid:`)")
    sweep.add_argument("--out", default="reports", help="folder for the plot (default: reports)")
    mutate = commands.add_parser("mutate", help="plant bugs in the captured distributed graph "
                                 "and check that the verifier catches them")
    mutate.add_argument("config", help="experiment YAML file (a correct configuration)")
    mutate.add_argument("--budget", type=int, default=4, help="mutants per operator (default: 4)")
    mutate.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    mutate.add_argument("--json", help="write every judged mutant here")
    return parser


def _mutate(args: argparse.Namespace, console: Console) -> int:
    from .mutate.campaign import run_campaign
    from .mutate.report import print_campaign, write_json
    from .mutate.subject import capture_subject

    with _bars(console) as bars:
        task = bars.add_task("mutants", total=None)
        campaign = run_campaign(capture_subject(args.config), args.budget, args.seed,
                                lambda done, total: bars.update(task, completed=done, total=total))
    print_campaign(campaign, console)
    if args.json:
        write_json([campaign], args.json)
    return 1 if campaign.survivors() else 0


def _bars(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    console=console, transient=True)


def _sweep(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from .sweep import run_sweep

    with _bars(console) as bars:
        task = bars.add_task("sweep", total=None)
        points = run_sweep(args.config, args.out,
                           lambda done, total: bars.update(task, completed=done, total=total))
    table = Table("point", "verdict", "capture s", "verify s", "windows")
    for point in points:
        t = point.report.timings
        table.add_row(", ".join(f"{k}={v}" for k, v in point.values.items()), point.report.verdict,
                      f"{t['capture_s']:.2f}", f"{t['verify_s']:.2f}",
                      str(point.report.stats["windows"]))
    console.print(table)
    return 0 if all(point.report.verified for point in points) else 1


def _verify(args: argparse.Namespace, console: Console) -> int:
    from .api import verify
    from .report.render import print_summary, to_html, to_json

    with _bars(console) as bars:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done)

        report = verify(args.config, numeric=args.numeric or None, progress=progress)
    print_summary(report, console)
    if args.json:
        to_json(report, args.json)
    if args.html:
        to_html(report, args.html)
    if not numeric_agrees(report):
        console.print("[bold red]the numeric cross-check disagrees with the verdict[/]")
    return exit_code(report)


def numeric_agrees(report: Report) -> bool:
    """Whether the numeric cross-check, if it ran, agrees with the verdict (an unknown verdict
    claims nothing)."""
    return (report.numeric is None or report.verdict == "unknown"
            or report.numeric["agrees"] in (None, report.verified))


def exit_code(report: Report) -> int:
    """0 when verified (and the numbers, if checked, agree), 3 when unknown (a window hit its
    limits), else 1."""
    if report.verdict == "unknown":
        return 3
    return 0 if report.verified and numeric_agrees(report) else 1


_COMMANDS = {"verify": _verify, "sweep": _sweep, "mutate": _mutate}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=False)
    try:
        return _COMMANDS[args.command](args, console)
    except ScalifyError as error:
        print(f"scalify: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
