"""A verification job's checkpoint: each finished segment's result, kept in a recovery
CheckpointStore (atomic, fsync'd, checksummed), so that a job run again after it failed proves
only the segments it had not finished."""
from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

from ..recovery.store import CheckpointStore
from ..verify.relations import Relation
from ..verify.verifier import SegmentRunner, Verification
from .job import VerifyJob


def job_fingerprint(job: VerifyJob) -> str:
    """Names a job by its content: the same graphs, options and placements, the same name."""
    return hashlib.sha256(pickle.dumps(job)).hexdigest()[:24]


class SegmentCheckpoint:
    """Finished segments of `job` under `folder`, one store block per segment index."""

    def __init__(self, folder: str | Path, job: VerifyJob) -> None:
        self.store = CheckpointStore(Path(folder) / job_fingerprint(job))
        self.resumed = 0

    def around(self, prove: SegmentRunner) -> SegmentRunner:
        """`prove`, skipping segments already saved and saving each one it proves."""
        def run(index: int, incoming: dict[str, Relation | None]) -> Verification:
            saved = self.store.load([index])
            if index in saved:
                self.resumed += 1
                return pickle.loads(saved[index].data)
            outcome = prove(index, incoming)
            self.store.save({index: pickle.dumps(outcome)}, index)
            return outcome
        return run
