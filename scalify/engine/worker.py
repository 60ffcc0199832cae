"""A segment worker: the plain class behind each Ray verification actor."""
from __future__ import annotations

from ..verify.relations import Relation
from ..verify.store import MemoStore
from ..verify.verifier import Verification, Verifier
from .job import VerifyJob


class SegmentWorker:
    """Proves segments of the jobs it holds, building each job's Verifier (and e-graph) once."""

    def __init__(self) -> None:
        self.verifiers: dict[str, Verifier] = {}

    def load(self, job_id: str, job: VerifyJob, store: MemoStore | None = None) -> None:
        """Hold `job` under `job_id`; its windows' proofs go to `store`."""
        self.verifiers[job_id] = job.verifier(store)

    def prove(self, job_id: str, index: int,
              incoming: dict[str, Relation | None]) -> Verification:
        """Segment `index` of a loaded job, given the relations flowing into it."""
        return self.verifiers[job_id].verify_segment(index, incoming)

    def release(self, job_id: str) -> None:
        """Drop a finished job."""
        self.verifiers.pop(job_id, None)
