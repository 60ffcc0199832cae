"""Logs a verification run to MLflow: the flattened config as params, timings and statistics as
metrics, the verdict as a tag, and the JSON/HTML reports and resolved config as artifacts."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .config import TrackingSpec
from .report.model import Report
from .report.render import to_html, to_json


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def log_run(report: Report, tracking: TrackingSpec, nested: bool = False) -> str:
    """Record one run in the MLflow store `tracking.uri` (inside the active run when `nested`);
    returns the run id."""
    import mlflow

    if not nested:
        mlflow.set_tracking_uri(tracking.uri)
        mlflow.set_experiment(tracking.experiment)
    metrics = {**report.timings,
               **{k: float(v) for k, v in report.stats.items() if isinstance(v, (int, float))},
               "discrepancies": float(len(report.discrepancies))}
    if report.numeric is not None and report.numeric["agrees"] is not None:
        metrics["numeric_max_relative_error"] = min(report.numeric["max_relative_error"], 1e300)
    with mlflow.start_run(run_name=report.name, nested=nested) as run, \
            tempfile.TemporaryDirectory() as folder:
        mlflow.log_params({k: str(v)[:500] for k, v in flatten(report.config).items()})
        mlflow.log_metrics(metrics)
        mlflow.set_tags({"verdict": report.verdict, "scalify.name": report.name,
                         **{k: v[:500] for k, v in report.stats.items() if isinstance(v, str)}})
        to_json(report, Path(folder) / "report.json")
        to_html(report, Path(folder) / "report.html")
        for name in ("report.json", "report.html"):
            mlflow.log_artifact(str(Path(folder) / name))
        mlflow.log_dict(report.config, "config.json")
        return run.info.run_id
