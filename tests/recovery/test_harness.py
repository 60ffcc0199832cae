"""The rework-cost harness on a small run of each workload, and its MLflow log."""
import numpy as np
import pytest

from scalify.recovery.harness import (Failure, crossing, iterations_to_threshold,
                                      reference_run, run_trials)
from scalify.recovery.layout import Layout
from scalify.recovery.strategies import strategies
from scalify.recovery.tracking import log_trials
from scalify.recovery.workloads import WORKLOADS


def test_crossing_interpolates_between_iterations():
    assert crossing([4.0, 3.0, 1.0], 2.0) == 1.5
    assert crossing([4.0, 3.0, 1.0], 2.0, start=10) == 11.5
    assert crossing([1.0, 0.5], 2.0) == 0.0


@pytest.fixture(scope="module")
def mlr_trials(tmp_path_factory):
    workload = WORKLOADS["mlr"]()
    reference = reference_run(workload, target=30, horizon=60)
    layout = Layout(workload.size, blocks=16, shards=4)
    failures = [Failure(13, 1), Failure(27, 3)]
    trials = run_trials(workload, reference, layout, strategies(8, 0.25), failures,
                        tmp_path_factory.mktemp("stores"))
    return workload, reference, trials


def test_the_reference_sets_the_threshold_and_rate(mlr_trials):
    workload, reference, _ = mlr_trials
    assert reference.reached == 30 and reference.threshold == reference.losses[30]
    assert 0 < reference.rate < 1
    clean = iterations_to_threshold(workload, reference.states[10], 10, reference.threshold, 99)
    assert clean == pytest.approx(reference.reached)  # replaying the reference costs nothing


def test_partial_recovery_costs_less_than_a_full_rollback(mlr_trials):
    _, _, trials = mlr_trials
    assert len(trials) == 2 * 5
    cost = {name: np.mean([t.rework for t in trials if t.strategy == name])
            for name in {t.strategy for t in trials}}
    assert cost["traditional"] >= 3  # five and three iterations since the last full save
    assert cost["partial"] < cost["traditional"] / 2
    assert cost["partial + prioritized"] < cost["traditional"] / 2
    for trial in trials:
        assert np.isfinite(trial.bound) and trial.bound >= 0


@pytest.mark.parametrize("name", ["mf", "lda"])
def test_other_workloads_converge_and_recover(name, tmp_path):
    workload = WORKLOADS[name]()
    reference = reference_run(workload, target=6, horizon=12)
    assert reference.losses[6] < reference.losses[0]
    layout = Layout(workload.size, blocks=8, shards=4)
    trials = run_trials(workload, reference, layout, strategies(4, 0.5)[:2], [Failure(5, 2)],
                        tmp_path)
    traditional, partial = trials
    assert partial.perturbation < traditional.perturbation


def test_each_trial_is_logged_to_mlflow(mlr_trials, tmp_path):
    import mlflow

    _, _, trials = mlr_trials
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    log_trials(trials[:3], uri, experiment="scar-test")
    runs = mlflow.search_runs(experiment_names=["scar-test"])
    assert len(runs) == 3
    logged = runs.sort_values("params.strategy").iloc[0]
    assert logged["params.failure_iteration"] == "13"
    assert {"metrics.rework_cost", "metrics.rework_bound",
            "metrics.perturbation_norm"} <= set(runs.columns)
