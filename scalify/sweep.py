"""Sweeps: expand a grid of overrides over one experiment, verify every point, plot the cost.

A sweep file is an experiment (model, plan, hardware, ...) plus `grid:`, a mapping from an
override path to a list of values; `tensor_parallel` sets the plan's degree and the device count
together. Points run one after another, or concurrently as Ray tasks when the experiment's
engine is Ray; with tracking enabled each is an MLflow run nested under one parent run, logged
once every point is done, which also holds the plot.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .config import load_experiment
from .engine import executor_for
from .errors import ConfigError
from .report.model import Report


@dataclass
class SweepPoint:
    values: dict[str, Any]
    report: Report


def load_sweep(path: str | Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The base experiment (as a dict) and the grid, validated."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: cannot read sweep: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("grid"), dict) or not data["grid"]:
        raise ConfigError(f"{path}: grid: expected a mapping from override paths to lists")
    grid = data.pop("grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid.{key}: expected a non-empty list")
    data.setdefault("name", Path(path).stem)
    return data, grid


def point_config(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    overrides = dict(base.get("overrides") or {})
    for key, value in values.items():
        if key == "tensor_parallel":
            overrides["plan.tensor_parallel"] = value
            overrides["hardware.devices"] = value
        else:
            overrides[key] = value
    label = ",".join(f"{k}={v}" for k, v in values.items())
    return {**base, "name": f"{base['name']}[{label}]", "overrides": overrides,
            "tracking": {"enabled": False}}


def run_sweep(path: str | Path, out_dir: str | Path = "reports",
              progress: Callable[[int, int], None] = lambda done, total: None) -> list[SweepPoint]:
    base, grid = load_sweep(path)
    combos = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    experiments = [load_experiment(point_config(base, values)) for values in combos]
    reports = executor_for(experiments[0].engine).verify_all(experiments, progress)
    points = [SweepPoint(values, report) for values, report in zip(combos, reports)]
    plot = plot_cost(points, Path(out_dir) / f"{base['name']}.png")
    tracking = base.get("tracking") or {}
    if tracking.get("enabled"):
        _log(base["name"], points, plot, tracking)
    return points


def plot_cost(points: list[SweepPoint], path: Path) -> Path:
    """Verify seconds against the first grid key, one line per value of the others."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    x_key = next(iter(points[0].values))
    series: dict[str, list[tuple[Any, float]]] = {}
    for point in points:
        rest = ", ".join(f"{k}={v}" for k, v in point.values.items() if k != x_key) or "all"
        series.setdefault(rest, []).append((point.values[x_key], point.report.timings["verify_s"]))
    figure, axes = pyplot.subplots(figsize=(6, 4))
    for label, values in series.items():
        xs, ys = zip(*sorted(values))
        axes.plot(xs, ys, marker="o", label=label)
    axes.set_xlabel(x_key)
    axes.set_ylabel("verify seconds (capture excluded)")
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    pyplot.close(figure)
    return path


def _log(name: str, points: list[SweepPoint], plot: Path, tracking: dict[str, Any]) -> None:
    import mlflow

    from .config import TrackingSpec
    from .tracking import log_run

    spec = TrackingSpec(**{"enabled": True, **tracking})
    mlflow.set_tracking_uri(spec.uri)
    mlflow.set_experiment(spec.experiment)
    with mlflow.start_run(run_name=name):
        mlflow.log_artifact(str(plot))
        mlflow.log_metric("points", len(points))
        mlflow.set_tag("verdict", "verified" if all(p.report.verified for p in points)
                       else "discrepancy")
        for point in points:
            log_run(point.report, spec, nested=True)
