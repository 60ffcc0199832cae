"""The inline executor (the default), the worker behind Ray's actors, and picking an executor."""
from functools import partial

import pytest

import scalify
from scalify.config import EngineSpec
from scalify.engine import InlineExecutor, executor_for
from scalify.engine.ray_executor import RayExecutor
from scalify.engine.worker import SegmentWorker

from ..verify.helpers import experiment
from .helpers import Recording

TINY = experiment("llama-tiny", "llama", 2)


class DictStore:
    """A MemoStore in a dict."""

    def __init__(self) -> None:
        self.entries: dict = {}

    def get(self, kind, key):
        return self.entries.get((kind, key))

    def put(self, kind, key, value):
        self.entries[(kind, key)] = value

    def commit(self):
        pass


@pytest.mark.parametrize("kind,ray_address,expected", [
    ("auto", None, InlineExecutor()),
    ("auto", "127.0.0.1:6379", RayExecutor(None, 2)),  # as inside `ray job submit`
    ("inline", "127.0.0.1:6379", InlineExecutor()),
    ("ray", None, RayExecutor(None, 2)),
])
def test_the_engine_section_picks_the_executor(monkeypatch, kind, ray_address, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    assert executor_for(EngineSpec(kind=kind)) == expected  # Ray is not started until used


def test_inline_is_the_default_and_its_store_keeps_proofs_between_runs():
    executor = InlineExecutor(DictStore())
    first = scalify.verify(TINY, executor=executor)
    again = scalify.verify(TINY, executor=executor)
    assert first.verified and again.verified and first.stats["engine"] == "inline"
    assert first.stats["memo_misses"] > 0 and again.stats["memo_misses"] == 0


def test_a_segment_worker_proves_what_the_verifier_proves():
    """The plain class each Ray actor wraps, run here: load a job once, prove its segments."""
    recording = Recording(InlineExecutor())
    scalify.verify(experiment("llama-tiny", "llama", 2, bug="missing-allreduce"), executor=recording)
    job, expected = recording.job, recording.result
    worker = SegmentWorker()
    worker.load("job-1", job)
    result = job.verifier().run(job.placements, job.outputs,
                                verify_segment=partial(worker.prove, "job-1"))
    assert result.relations == expected.relations
    assert result.discrepancies == expected.discrepancies != []
