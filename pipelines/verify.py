"""The `ray job submit` entry point: verify one experiment on the cluster and log it to MLflow.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        /path/to/.venv/bin/python pipelines/verify.py CONFIG --tracking-uri sqlite:////abs/mlruns.db

(docs/ray.md, "Running on Ray", has the full recipe.)

Proves on Ray actors (joining the job's cluster, or starting a local one outside a job), logs the
run to MLflow (`--tracking-uri`, default the config's, `sqlite:///mlruns.db`: relative paths land
in the job's working directory), prints the summary, then one line `SCALIFY_RESULT {json}`.
Exit codes as `scalify verify`: 0 verified, 1 discrepancy, 2 bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the uploaded copy of scalify

from rich.console import Console  # noqa: E402

from scalify.api import verify  # noqa: E402
from scalify.cli import exit_code, numeric_agrees  # noqa: E402
from scalify.config import Experiment, load_experiment  # noqa: E402
from scalify.errors import ScalifyError  # noqa: E402
from scalify.report.model import Report  # noqa: E402
from scalify.report.render import print_summary, to_html, to_json  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("--json", help="write the JSON report here")
    parser.add_argument("--html", help="write the HTML report here")
    parser.add_argument("--tracking-uri", help="MLflow store (default: the config's tracking.uri)")
    return parser


def on_ray_with_tracking(experiment: Experiment, tracking_uri: str | None) -> Experiment:
    """The experiment with the Ray engine and MLflow tracking switched on."""
    tracking = dataclasses.replace(experiment.tracking, enabled=True,
                                   uri=tracking_uri or experiment.tracking.uri)
    return dataclasses.replace(experiment, tracking=tracking,
                               engine=dataclasses.replace(experiment.engine, kind="ray"))


def result_line(report: Report) -> str:
    """The last line of the job's log, for whoever submitted it."""
    summary = {"name": report.name, "verdict": report.verdict, "verified": report.verified,
               "discrepancies": len(report.discrepancies), "numeric_agrees": numeric_agrees(report),
               "timings": report.timings,
               "stats": report.stats}
    return f"SCALIFY_RESULT {json.dumps(summary, default=str)}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    try:
        report = verify(on_ray_with_tracking(load_experiment(args.config), args.tracking_uri))
    except ScalifyError as error:
        print(f"scalify: error: {error}", file=sys.stderr)
        return 2
    print_summary(report, console)
    if args.json:
        to_json(report, args.json)
    if args.html:
        to_html(report, args.html)
    print(result_line(report), flush=True)
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
