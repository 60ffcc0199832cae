"""Sweeps: every grid point is verified, the cost is plotted, and runs nest under one parent."""
import mlflow
import pytest
import yaml

from scalify.cli import main
from scalify.errors import ConfigError
from scalify.sweep import load_sweep, run_sweep


def test_sweep_verifies_every_point_and_plots(tmp_path):
    points = run_sweep("configs/sweeps/llama-tiny-tp-layers.yaml", tmp_path)
    assert len(points) == 6 and all(p.report.verified for p in points)
    assert (tmp_path / "llama-tiny-tp-layers.png").stat().st_size > 0


def test_sweep_runs_nest_under_a_parent_mlflow_run(tmp_path):
    sweep = yaml.safe_load(open("configs/sweeps/llama-tiny-tp-layers.yaml"))
    sweep["grid"] = {"tensor_parallel": [1, 2]}
    sweep["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'm.db'}",
                         "experiment": "sweep-test"}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", str(path), "--out", str(tmp_path)]) == 0
    client = mlflow.MlflowClient(tracking_uri=sweep["tracking"]["uri"])
    runs = client.search_runs([client.get_experiment_by_name("sweep-test").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 2
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id)} == {"s.png"}


def test_sweep_without_grid_is_a_config_error(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: llama-tiny\n")
    with pytest.raises(ConfigError, match="grid"):
        load_sweep(path)
