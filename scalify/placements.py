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


@dataclass(frozen=True)
class Stage(Placement):
    """Only rank `rank` holds the reference tensor, whole (a pipeline stage's parameters, its
    inputs and outputs); the other ranks' programs do not have it at all."""

    rank: int

    def holds(self, rank: int) -> bool:
        return rank == self.rank

    def __str__(self) -> str:
        return f"Stage({self.rank})"


@dataclass(frozen=True)
class Piece:
    """Indices [ref_start, ref_start + size) of the reference tensor along the layout's dim are
    indices [local_start, local_start + size) of rank `rank`'s tensor `local` (its name in the
    rank's module, which may differ from the reference's, e.g. a fused `qkv_proj.weight`; or
    `name@j`, slab j along dim 0 of a rank tensor stacked from pieces: experts' weights)."""

    rank: int
    local: str
    local_start: int
    ref_start: int
    size: int


@dataclass(frozen=True)
class Custom(Placement):
    """The reference tensor is assembled along `dim` from pieces of rank tensors (fused and
    interleaved layouts). Pieces must cover every index; pieces covering the same indices are
    replicas, and a rank tensor may hold pieces of several reference tensors."""

    dim: int
    pieces: tuple[Piece, ...]

    def even_blocks(self, world: int) -> tuple[str, list[tuple[int, int]]] | None:
        """When every rank holds, in one tensor of one name, the same local blocks and block k
        of the reference is the ranks' k-th blocks in rank order (a fused weight split block by
        block): that name and the blocks' (local start, size) in reference order; else None."""
        names = {p.local for p in self.pieces}
        pieces = sorted(self.pieces, key=lambda p: (p.ref_start, p.rank))
        if len(names) != 1 or len(pieces) % world:
            return None
        blocks, covered = [], 0
        for first in range(0, len(pieces), world):
            group = pieces[first:first + world]
            block = (group[0].local_start, group[0].size)
            if any((p.rank, p.ref_start, p.local_start, p.size) != (r, covered + r * block[1], *block)
                   for r, p in enumerate(group)):
                return None
            blocks.append(block)
            covered += world * block[1]
        return names.pop(), blocks

    def __str__(self) -> str:
        held: dict[str, list[str]] = {}
        for p in sorted(self.pieces, key=lambda p: (p.ref_start, p.rank)):
            held.setdefault(p.local, []).append(
                f"r{p.rank}[{p.local_start}:{p.local_start + p.size}]")
        parts = [f"{local} {' '.join(spans[:4])}{' ...' if len(spans) > 4 else ''}"
                 for local, spans in held.items()]
        return f"Custom({self.dim}, {'; '.join(parts)})"


def parse_placement(text: str) -> Placement:
    """`Replicate()`, `Shard(dim)` or `Partial(sum|max)` (`Partial()` sums), as written in configs."""
    kind, _, rest = text.strip().partition("(")
    argument = rest.rstrip(")").strip()
    if not rest.endswith(")"):
        raise ValueError(f"expected Replicate(), Shard(dim) or Partial(op), got {text!r}")
    if kind == "Replicate" and not argument:
        return Replicate()
    if kind == "Shard" and argument.lstrip("-").isdigit():
        return Shard(int(argument))
    if kind == "Partial" and argument in ("", "sum", "max"):
        return Partial(argument or "sum")
    raise ValueError(f"expected Replicate(), Shard(dim) or Partial(op), got {text!r}")


SLAB = "@"  # `name@j`: slab j along dim 0 of rank tensor `name`


def slab_name(local: str, index: int) -> str:
    return f"{local}{SLAB}{index}"


def slabbed(placements: dict[str, Placement]) -> set[str]:
    """The rank tensors that Custom pieces read slab by slab."""
    return {piece.local.rpartition(SLAB)[0] for placement in placements.values()
            if isinstance(placement, Custom) for piece in placement.pieces
            if SLAB in piece.local}

