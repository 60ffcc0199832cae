"""A mutation campaign: judge every sampled mutant by its numbers and by the verifier."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..api import verify_graphs
from ..errors import ScalifyError
from ..ir.distributed import merge_ranks
from ..ir.graph import SourceLoc
from ..verify.numeric import cross_check
from .mutants import Mutant, mutants
from .operators import OPERATORS
from .subject import Subject


@dataclass(frozen=True)
class Judgement:
    """What one mutant did: whether its numbers differ from the reference's, and the verdict
    ("verified", "discrepancy", or "error" when the verifier refused the graphs)."""

    operator: str
    node: str
    what: str
    source: str
    numbers_change: bool
    verdict: str
    detail: str = ""

    @property
    def caught(self) -> bool:
        return self.numbers_change and self.verdict != "verified"

    @property
    def survivor(self) -> bool:
        return self.numbers_change and self.verdict == "verified"

    @property
    def false_alarm(self) -> bool:
        return not self.numbers_change and self.verdict != "verified"


@dataclass
class Campaign:
    """Every judged mutant of one subject."""

    name: str
    judgements: list[Judgement] = field(default_factory=list)

    def survivors(self) -> list[Judgement]:
        return [j for j in self.judgements if j.survivor]

    def false_alarms(self) -> list[Judgement]:
        return [j for j in self.judgements if j.false_alarm]


def judge(subject: Subject, mutant: Mutant) -> Judgement | None:
    """Run the mutant's numbers and verify it; None when its ranks cannot even be merged
    (a mismatched collective or send: the ranks would hang, no numbers to compare)."""
    try:
        dist = merge_ranks(mutant.ranks)
    except ScalifyError:
        return None
    numbers = cross_check(subject.reference, dist, subject.placements, subject.outputs)
    try:
        report = verify_graphs(subject.reference, mutant.ranks, subject.placements,
                               subject.outputs, options=subject.options)
        verdict = report.verdict
        detail = report.discrepancies[0].location if report.discrepancies else ""
    except ScalifyError as error:
        verdict, detail = "error", str(error).splitlines()[0]
    return Judgement(mutant.operator, mutant.node, mutant.what, str(mutant.source),
                     not numbers["agrees"], verdict, detail)


def run_campaign(subject: Subject, budget: int, seed: int = 0,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> Campaign:
    """Judge at most `budget` mutants per operator, after checking that the unmutated
    configuration verifies and agrees numerically (else a mutant's verdict means nothing)."""
    baseline = judge(subject, Mutant("none", "", "unmutated", SourceLoc(), subject.ranks))
    if baseline is None or baseline.numbers_change or baseline.verdict != "verified":
        raise ScalifyError(f"{subject.name} is not a correct configuration to mutate: "
                           f"{baseline.verdict if baseline else 'its ranks do not merge'}")
    sampled = [m for operator in OPERATORS for m in mutants(subject.ranks, operator, budget, seed)]
    campaign = Campaign(subject.name)
    for done, mutant in enumerate(sampled, 1):
        judgement = judge(subject, mutant)
        if judgement is not None:
            campaign.judgements.append(judgement)
        progress(done, len(sampled))
    return campaign
