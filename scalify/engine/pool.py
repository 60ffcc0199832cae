"""A pool of verification actors, and the dispatcher that proves one job's segments on it."""
from __future__ import annotations

import queue
import threading

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, WorkerCrashedError

from ..verify.relations import Relation
from ..verify.verifier import Verification
from .cluster import resolve
from .memo import RemoteStore
from .worker import SegmentWorker

VerifyWorker = ray.remote(SegmentWorker)
ACTOR_LOST = (RayActorError, WorkerCrashedError)
ATTEMPTS = 3  # a segment that takes down this many actors is an error, not bad luck


class WorkerPool:
    """Verification actors lent out one segment at a time, the most recently returned first (it
    holds the job already); a lost one is replaced."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.members = [VerifyWorker.remote() for _ in range(size)]
        self._idle: queue.LifoQueue[ActorHandle] = queue.LifoQueue()
        self._lock = threading.Lock()
        for actor in self.members:
            self._idle.put(actor)

    def acquire(self) -> ActorHandle:
        """An idle actor; waits for one."""
        return self._idle.get()

    def release(self, actor: ActorHandle) -> None:
        self._idle.put(actor)

    def replace(self, lost: ActorHandle) -> ActorHandle:
        """A new actor in place of `lost`, lent to the caller."""
        fresh = VerifyWorker.remote()
        with self._lock:
            self.members[self.members.index(lost)] = fresh
        return fresh

    def forget(self, job_id: str) -> None:
        """Tell every actor to drop a finished job."""
        with self._lock:
            for actor in self.members:
                actor.release.remote(job_id)

    def close(self) -> None:
        with self._lock:
            for actor in self.members:
                ray.kill(actor)


class Dispatcher:
    """Proves one job's segments on a pool's actors. When an actor is lost, the segment it had
    in flight (and only that one) is proved again on its replacement."""

    def __init__(self, pool: WorkerPool, job_id: str, job_ref: ray.ObjectRef,
                 store: RemoteStore | None) -> None:
        self.pool, self.job_id, self.job_ref, self.store = pool, job_id, job_ref, store
        self.dispatched = 0
        self.retried = 0
        self._loaded: set[ActorHandle] = set()

    def prove(self, index: int, incoming: dict[str, Relation | None]) -> Verification:
        """A `SegmentRunner` for `Verifier.run`."""
        actor = self.pool.acquire()
        try:
            for _ in range(ATTEMPTS - 1):
                try:
                    return resolve(self.submit(actor, index, incoming))
                except ACTOR_LOST:
                    self.retried += 1
                    actor = self.pool.replace(actor)
            return resolve(self.submit(actor, index, incoming))
        finally:
            self.pool.release(actor)

    def submit(self, actor: ActorHandle, index: int,
               incoming: dict[str, Relation | None]) -> ray.ObjectRef:
        """Send segment `index` to `actor`, and the job first if the actor has not seen it."""
        if actor not in self._loaded:
            actor.load.remote(self.job_id, self.job_ref, self.store)
            self._loaded.add(actor)
        self.dispatched += 1
        return actor.prove.remote(self.job_id, index, incoming)
