"""What an executor is given (one verification job) and what it must offer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..ir.distributed import DistributedGraph
from ..ir.graph import Graph
from ..placements import Placement
from ..verify.store import MemoStore
from ..verify.verifier import Verification, Verifier, VerifyOptions

if TYPE_CHECKING:
    from ..config import Experiment
    from ..report.model import Report

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class VerifyJob:
    """One verification: the captured graphs, the verifier's options and the placements of the
    reference's inputs and outputs across ranks. Plain data, so it can travel to other processes."""

    reference: Graph
    dist: DistributedGraph
    options: VerifyOptions
    placements: dict[str, Placement]
    outputs: list[Placement]

    def verifier(self, store: MemoStore | None = None) -> Verifier:
        """A Verifier for this job, ready to prove any of its segments."""
        verifier = Verifier(self.reference, self.dist, self.options, store=store)
        verifier.placements = self.placements
        return verifier


class Executor(Protocol):
    """Runs verification jobs (`run`) and whole experiments, e.g. the points of a sweep
    (`verify_all`); `run` returns the verification and the executor's statistics."""

    def run(self, job: VerifyJob, progress: Progress) -> tuple[Verification, dict[str, Any]]: ...

    def verify_all(self, experiments: list[Experiment], progress: Progress) -> list[Report]: ...
