"""A Ray verification job that dies with a worker, run again with a segment checkpoint, proves
only its unfinished segments and reaches the verdict of an uninterrupted run."""
import pytest
import ray
from ray.exceptions import RayActorError

import scalify
from scalify.engine.cluster import LOCAL_TEMP_DIR
from scalify.engine.pool import Dispatcher
from scalify.engine.ray_executor import RayExecutor

from ..verify.helpers import experiment
from .helpers import Recording

# A Ray cluster per test module: under `pytest -n` these run on one worker, one at a time.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def executor():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(LOCAL_TEMP_DIR))
    executor = RayExecutor(actors=1)
    yield executor
    executor.close()
    ray.shutdown()


def test_a_job_rerun_after_losing_a_worker_redoes_only_unfinished_segments(executor, tmp_path,
                                                                           monkeypatch):
    config = {**experiment("llama-tiny", "llama", 2, bug="missing-allreduce"),
              "verify": {"memo": False}}
    recording = Recording(executor)
    uninterrupted = scalify.verify(config, executor=recording)
    segments = len(recording.job.verifier().segments)
    assert uninterrupted.verdict == "discrepancy" and segments == 3

    executor.checkpoint = str(tmp_path)
    submit = Dispatcher.submit

    def submit_then_kill(self, actor, index, incoming):
        pending = submit(self, actor, index, incoming)
        if index == 1:  # the worker dies with the layer's segment in flight
            ray.kill(actor)
        return pending

    with monkeypatch.context() as patch:
        patch.setattr(Dispatcher, "submit", submit_then_kill)
        patch.setattr("scalify.engine.pool.ATTEMPTS", 1)  # so the loss ends the job
        with pytest.raises(RayActorError):
            scalify.verify(config, executor=executor)

    rerun = scalify.verify(config, executor=executor)
    assert rerun.stats["segments_resumed"] == 1  # segment 0 came from the checkpoint
    assert rerun.stats["segments_dispatched"] - rerun.stats["segments_retried"] == segments - 1
    assert rerun.verdict == uninterrupted.verdict
    assert rerun.discrepancies == uninterrupted.discrepancies
