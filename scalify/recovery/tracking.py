"""Logs rework-cost trials to MLflow: one run per trial, its workload, strategy and failure as
params, the rework cost, the bound and the perturbation's norm as metrics."""
from __future__ import annotations

import math

from .harness import Trial


def log_trials(trials: list[Trial], uri: str, experiment: str = "scar") -> list[str]:
    """Record each trial in the MLflow store at `uri`; returns the run ids."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    ids = []
    for trial in trials:
        name = f"{trial.workload} {trial.strategy} T={trial.failure.iteration}"
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_params({"workload": trial.workload, "strategy": trial.strategy,
                               "failure_iteration": trial.failure.iteration,
                               "lost_shard": trial.failure.lost_shard})
            metrics = {"rework_cost": trial.rework, "perturbation_norm": trial.perturbation}
            if math.isfinite(trial.bound):
                metrics["rework_bound"] = trial.bound
            mlflow.log_metrics(metrics)
            ids.append(run.info.run_id)
    return ids
