"""The Ray executor: segments proved on a pool of actors, sweep points run as Ray tasks, and
every proof kept by one memo actor per job."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from ..verify.verifier import Verification
from .cluster import connect, resolve
from .inline import InlineExecutor
from .job import Progress, VerifyJob
from .memo import RemoteStore, memo_store
from .pool import Dispatcher, WorkerPool
from .resume import SegmentCheckpoint

if TYPE_CHECKING:
    from ..config import Experiment
    from ..report.model import Report


@dataclass
class RayExecutor:
    """Joins the cluster at `address` (see `connect`) and starts `actors` verification actors
    on first use; they, and the memo actors, serve every job this executor runs until `close`.
    With `checkpoint` (a folder), each finished segment is saved there, and a job run again
    after a failure proves only its unfinished segments."""

    address: str | None = None
    actors: int = 2
    checkpoint: str | None = None
    _pool: WorkerPool | None = field(default=None, init=False, repr=False)
    _stores: dict[str | None, RemoteStore] = field(default_factory=dict, init=False, repr=False)

    @property
    def pool(self) -> WorkerPool:
        """The verification actors, started (and the cluster joined) on first use."""
        if self._pool is None:
            connect(self.address)
            self._pool = WorkerPool(self.actors)
        return self._pool

    def run(self, job: VerifyJob,
            progress: Progress = lambda done, total: None) -> tuple[Verification, dict[str, Any]]:
        """Drive the job here (layer memo, output checks) and prove missed segments on actors."""
        pool = self.pool
        store = self._store(job.options.memo, job.options.memo_store)
        dispatcher = Dispatcher(pool, uuid.uuid4().hex, ray.put(job), store)
        finished = SegmentCheckpoint(self.checkpoint, job) if self.checkpoint else None
        prove = finished.around(dispatcher.prove) if finished else dispatcher.prove
        try:
            result = job.verifier(store).run(job.placements, job.outputs, progress, prove)
        finally:
            pool.forget(dispatcher.job_id)
        stats = {"engine": "ray", "actors": pool.size,
                 "segments_dispatched": dispatcher.dispatched,
                 "segments_retried": dispatcher.retried}
        if finished:
            stats["segments_resumed"] = finished.resumed
        return result, stats

    def verify_all(self, experiments: list[Experiment],
                   progress: Progress = lambda done, total: None) -> list[Report]:
        """Verify the experiments concurrently, each in a Ray task; reports in the given order."""
        connect(self.address)
        refs = [_verify_in_task.remote(experiment, self._store(experiment.verify.memo,
                                                               experiment.verify.memo_store))
                for experiment in experiments]
        position = {ref: index for index, ref in enumerate(refs)}
        reports: list[Any] = [None] * len(refs)
        pending = refs
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            reports[position[ready[0]]] = resolve(ready[0])
            progress(len(refs) - len(pending), len(refs))
        return reports

    def close(self) -> None:
        """Stop the actors (they stop anyway when this process leaves the cluster)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._stores.clear()

    def _store(self, memo: bool, path: str | None) -> RemoteStore | None:
        """The store of the memo actor for `path`; None when memoisation is off."""
        if not memo:
            return None
        if path not in self._stores:
            self._stores[path] = memo_store(path)
        return self._stores[path]


@ray.remote
def _verify_in_task(experiment: Experiment, store: RemoteStore | None) -> Report:
    """Capture and prove one experiment inside this task, sharing proofs through `store`."""
    from ..api import verify

    return verify(experiment, executor=InlineExecutor(store, name="ray task"))
