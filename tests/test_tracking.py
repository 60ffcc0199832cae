"""Every run can be logged to MLflow: params, metrics, verdict tag and report artifacts."""
import mlflow

import scalify
from scalify.tracking import flatten

from .verify.helpers import experiment


def test_flatten_joins_nested_keys():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_run_is_logged_with_verdict_metrics_and_reports(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = experiment("llama-tiny", "llama", 2)
    config["tracking"] = {"enabled": True, "uri": uri, "experiment": "scalify-test"}
    report = scalify.verify(config)
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(report.stats["mlflow_run_id"])
    assert run.data.tags["verdict"] == "verified"
    assert run.data.metrics["total_s"] > 0 and run.data.metrics["windows"] > 0
    assert run.data.metrics["rule_matches"] > 0 and run.data.metrics["largest_egraph_nodes"] > 0
    assert run.data.tags["rank_symmetry"] == "used" and run.data.tags["engine"] == "inline"
    assert run.data.params["plan.tensor_parallel"] == "2"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.json", "report.html", "config.json"} <= artifacts
