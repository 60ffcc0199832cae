"""The Ray executor: the inline verdicts and relations, a lost actor costs only the segment it
had in flight, and sweep points run as Ray tasks."""
import pytest
import ray
import yaml

import scalify
from scalify.engine import InlineExecutor
from scalify.engine.cluster import LOCAL_TEMP_DIR
from scalify.engine.pool import Dispatcher
from scalify.engine.ray_executor import RayExecutor
from scalify.sweep import run_sweep

from ..verify.helpers import experiment
from .helpers import Recording

# A Ray cluster per test module: under `pytest -n` these run on one worker, one at a time.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(LOCAL_TEMP_DIR))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def executor(local_ray):
    executor = RayExecutor(actors=2)
    yield executor
    executor.close()


@pytest.mark.parametrize("bug", [None, "missing-allreduce"])
def test_ray_finds_what_inline_finds(executor, bug):
    config = experiment("llama-tiny", "llama", 2, bug=bug)
    inline, on_ray = Recording(InlineExecutor()), Recording(executor)
    expected = scalify.verify(config, executor=inline)
    report = scalify.verify(config, executor=on_ray)
    assert report.verdict == expected.verdict == ("discrepancy" if bug else "verified")
    assert report.discrepancies == expected.discrepancies  # same ops, lines and hints
    assert on_ray.result.relations == inline.result.relations
    assert report.stats["engine"] == "ray" and report.stats["actors"] == 2
    assert report.stats["segments_retried"] == 0


def test_a_lost_actor_costs_only_its_segment_in_flight(executor, monkeypatch):
    submit, killed = Dispatcher.submit, []

    def submit_then_kill(self, actor, index, incoming):
        pending = submit(self, actor, index, incoming)
        if index == 1 and not killed:  # the actor dies with segment 1 in flight
            ray.kill(actor)
            killed.append(actor)
        return pending

    monkeypatch.setattr(Dispatcher, "submit", submit_then_kill)
    recording = Recording(executor)
    config = {**experiment("llama-tiny", "llama", 2), "verify": {"memo": False}}  # no reuse
    report = scalify.verify(config, executor=recording)
    segments = len(recording.job.verifier().segments)
    assert killed and report.verified
    assert report.stats["segments_retried"] == 1
    assert report.stats["segments_dispatched"] == segments + 1  # every segment once, one twice
    assert killed[0] not in executor.pool.members


def test_sweep_points_run_as_ray_tasks(local_ray, tmp_path):
    sweep = yaml.safe_load(open("configs/sweeps/llama-tiny-tp-layers.yaml"))
    sweep["grid"] = {"tensor_parallel": [1, 2]}
    sweep["engine"] = {"kind": "ray"}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep))
    points = run_sweep(path, tmp_path)
    assert [p.values for p in points] == [{"tensor_parallel": 1}, {"tensor_parallel": 2}]
    assert all(p.report.verified and p.report.stats["engine"] == "ray task" for p in points)
    assert (tmp_path / "s.png").stat().st_size > 0
