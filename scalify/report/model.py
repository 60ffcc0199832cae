"""The result of a run: verdict, discrepancies with their source lines, statistics and timings."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..ir.graph import SourceLoc


@dataclass
class Discrepancy:
    """A reference op whose output has no relation to the ranks' tensors (or not the expected one)."""

    ref_op: str
    ref_node: str
    module: str
    ref_source: SourceLoc
    dist_source: SourceLoc
    found: str
    expected: str
    hint: str
    inputs: list[str] = field(default_factory=list)
    nearby: list[SourceLoc] = field(default_factory=list)
    path: list[SourceLoc] = field(default_factory=list)  # rank ops back to values proven equal
    placements: list[str] = field(default_factory=list)  # sharded parameters feeding the op

    @property
    def location(self) -> str:
        """Where the ranks compute the op; the reference's line where no rank op was found."""
        if self.dist_source.file:
            return str(self.dist_source)
        return f"{self.ref_source} (reference; no rank op found)"

    def lines(self) -> set[tuple[str, int]]:
        """Every distributed source line the discrepancy names, with the lines that called them,
        the lines whose scalar factors were moved into them, the lines that passed their values
        on (returned, copied, or wrote them into a buffer) and the lines that set the Python
        values (offsets, scales, groups) their lines read: what the report shows of each."""
        places = [place for loc in [self.dist_source, *self.path, *self.nearby]
                  for place in (*loc.callers, *loc.scaled_at, *loc.passed_at, *loc.values_from)]
        named = {(loc.file, loc.line) for loc in [self.dist_source, *self.path, *self.nearby]
                 if loc.file}
        for place in places:
            file, _, line = place.rpartition(":")
            named.add((file, int(line)))
        return named


@dataclass
class Report:
    """What `scalify.verify` returns."""

    name: str
    verified: bool
    verdict: str  # "verified", "discrepancy" or "unknown"
    discrepancies: list[Discrepancy] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    numeric: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # why parts gave no answer (a limit hit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
