"""The inline executor: every segment is proved in this process, one after another."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..verify.store import MemoStore
from ..verify.verifier import Verification
from .job import Progress, VerifyJob

if TYPE_CHECKING:
    from ..config import Experiment
    from ..report.model import Report


@dataclass
class InlineExecutor:
    """The default for small jobs. `store` keeps proofs (default: the job's options decide, a
    ProofStore at `memo_store` or none); `name` is what the report's `engine` statistic says."""

    store: MemoStore | None = None
    name: str = "inline"

    def run(self, job: VerifyJob,
            progress: Progress = lambda done, total: None) -> tuple[Verification, dict[str, Any]]:
        result = job.verifier(self.store).run(job.placements, job.outputs, progress)
        return result, {"engine": self.name}

    def verify_all(self, experiments: list[Experiment],
                   progress: Progress = lambda done, total: None) -> list[Report]:
        """Verify the experiments one after another."""
        from ..api import verify

        reports = []
        for done, experiment in enumerate(experiments, 1):
            reports.append(verify(experiment, executor=self))
            progress(done, len(experiments))
        return reports
