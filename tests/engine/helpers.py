"""An executor wrapper that keeps what it ran, for comparing executors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scalify.engine import Executor, VerifyJob
from scalify.verify.verifier import Verification


@dataclass
class Recording:
    """Runs jobs on `inner` and keeps the last job and its verification (relations included)."""

    inner: Executor
    job: VerifyJob | None = None
    result: Verification | None = None

    def run(self, job: VerifyJob, progress: Any) -> tuple[Verification, dict[str, Any]]:
        self.job = job
        self.result, stats = self.inner.run(job, progress)
        return self.result, stats
