"""Placements: how a reference tensor relates to the tensors the ranks hold (DTensor's vocabulary)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field


def _caller_location() -> str:
    """`file:line` of the first frame outside this module (where a placement was declared)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else ""


@dataclass(frozen=True)
class Placement:
    """Base of all placements; `declared_at` records the source line that stated it."""

    declared_at: str = field(default_factory=_caller_location, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank holds the whole reference tensor."""

    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard(Placement):
    """The reference tensor is split along `dim`.

    `blocks > 1` describes fused layouts (e.g. GPT-2's [q|k|v] columns): the dim is cut into
    `blocks` equal blocks, each block is split across the chunks, and a rank's local tensor is the
    concatenation of its piece of every block. `chunk_of_rank[r]` names the chunk rank r holds
    (default: chunk r), so several ranks may hold the same chunk (replicated GQA kv heads).
    """

    dim: int = 0
    blocks: int = 1
    chunk_of_rank: tuple[int, ...] | None = None

    def chunks(self, world_size: int) -> tuple[int, ...]:
        """The chunk index each rank holds."""
        return self.chunk_of_rank if self.chunk_of_rank is not None else tuple(range(world_size))

    def __str__(self) -> str:
        extra = f", blocks={self.blocks}" if self.blocks != 1 else ""
        extra += f", chunk_of_rank={list(self.chunk_of_rank)}" if self.chunk_of_rank else ""
        return f"Shard({self.dim}{extra})"


@dataclass(frozen=True)
class Partial(Placement):
    """The reference tensor is the sum (or max) of the ranks' tensors."""

    op: str = "sum"

    def __str__(self) -> str:
        return f"Partial({self.op})"
