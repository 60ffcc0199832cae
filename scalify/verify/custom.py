"""Custom placements (pieces of rank tensors along one dim): tiling check, relation, rank values."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ShapeError
from ..placements import Custom, Piece, Placement
from .relations import Relation, concat_terms, leaf

Shape = tuple[int, ...]


def rank_name(piece: Piece) -> str:
    """The distributed graph's name of the rank tensor a piece lies in."""
    return f"r{piece.rank}/{piece.local}"


def check_tiling(target: str, placement: Custom, ref_shape: Shape) -> None:
    """Every index of the reference dim lies in some piece, and every piece inside it."""
    dim = placement.dim % len(ref_shape)
    size, covered = ref_shape[dim], 0
    for piece in sorted(placement.pieces, key=lambda p: p.ref_start):
        if piece.size <= 0 or piece.ref_start < 0 or piece.ref_start + piece.size > size:
            raise ShapeError(f"{target}: piece {piece} lies outside dim {dim} of size {size}")
        if piece.ref_start > covered:
            raise ShapeError(f"{target}: indices [{covered}:{piece.ref_start}) of dim {dim} are "
                             "held by no rank (the rank pieces leave a gap)")
        covered = max(covered, piece.ref_start + piece.size)
    if covered < size:
        raise ShapeError(f"{target}: indices [{covered}:{size}) of dim {dim} are held by no rank "
                         "(the rank pieces leave a gap)")


def _spans(placement: Custom, size: int) -> list[tuple[int, int, Piece]]:
    """The dim cut at every piece boundary: (start, end, the lowest-rank piece covering it)."""
    cuts = sorted({0, size, *(p.ref_start for p in placement.pieces),
                   *(p.ref_start + p.size for p in placement.pieces)})
    order = sorted(placement.pieces, key=lambda p: (p.rank, p.local, p.local_start))
    spans = []
    for start, end in zip(cuts, cuts[1:]):
        owner = next(p for p in order if p.ref_start <= start and end <= p.ref_start + p.size)
        if spans and spans[-1][2] == owner:
            spans[-1] = (spans[-1][0], end, owner)
        else:
            spans.append((start, end, owner))
    return spans


def _local(piece: Piece, start: int, end: int) -> tuple[int, int]:
    """The rank tensor's indices holding reference indices [start, end) of `piece`."""
    offset = piece.local_start - piece.ref_start
    return start + offset, end + offset


def _slice(name: str, dim: int, start: int, end: int, shape: Shape) -> str:
    whole = start == 0 and end == shape[dim]
    return leaf(name) if whole else f"(slice {leaf(name)} {dim} {start} {end})"


def family_custom_relation(placement: Custom, ref_shape: Shape, local_shape: Shape,
                           world: int) -> Relation:
    """The relation of an even-block Custom placement over a rank family: block by block, the
    family's concatenation of each rank's block."""
    name, blocks = placement.even_blocks(world)
    dim = placement.dim % len(ref_shape)
    terms = [f"(rcat {_slice(f'r0/{name}', dim, start, start + size, local_shape)} {dim} {size})"
             for start, size in blocks]
    return Relation(concat_terms(terms, [size * world for _, size in blocks], dim))


def custom_relation(target: str, placement: Custom, ref_shape: Shape,
                    shape_of: Callable[[str], Shape | None]) -> Relation:
    """ref = concat of the owners' slices (one nested concat per run of one rank tensor's slices,
    as that rank's own split of it reads); every other piece is a replica of its owner's slice,
    stated as a fact: its rank tensor equals itself with that slice replaced by the owner's."""
    check_tiling(target, placement, ref_shape)
    dim = placement.dim % len(ref_shape)
    shapes = {}
    for piece in placement.pieces:
        name = rank_name(piece)
        shape = shape_of(name)
        if shape is None:
            raise ShapeError(f"{target}: rank {piece.rank}'s program has no input {piece.local}")
        others = [s for d, s in enumerate(shape) if d != dim]
        if len(shape) != len(ref_shape) or others != [s for d, s in enumerate(ref_shape) if d != dim] \
                or piece.local_start < 0 or piece.local_start + piece.size > shape[dim]:
            raise ShapeError(f"{target}: rank {piece.rank} holds {piece.local} of shape "
                             f"{list(shape)}, which cannot hold {piece} of the reference shape "
                             f"{list(ref_shape)} along dim {dim}")
        shapes[name] = tuple(shape)
    spans = _spans(placement, ref_shape[dim])
    runs: list[list[tuple[int, int, Piece]]] = []  # consecutive spans of one rank tensor
    for span in spans:
        if runs and rank_name(runs[-1][-1][2]) == rank_name(span[2]):
            runs[-1].append(span)
        else:
            runs.append([span])
    terms = [concat_terms([_slice(rank_name(owner), dim, *_local(owner, start, end),
                                  shapes[rank_name(owner)]) for start, end, owner in run],
                          [end - start for start, end, _ in run], dim) for run in runs]
    sizes = [run[-1][1] - run[0][0] for run in runs]
    facts = []
    for piece in placement.pieces:
        for start, end, owner in spans:
            lo, hi = max(start, piece.ref_start), min(end, piece.ref_start + piece.size)
            if piece == owner or lo >= hi:
                continue
            facts.append(_replica_fact(piece, owner, lo, hi, dim, shapes))
    return Relation(concat_terms(terms, sizes, dim), tuple(dict.fromkeys(facts)))


def _replica_fact(piece: Piece, owner: Piece, start: int, end: int, dim: int,
                  shapes: dict[str, Shape]) -> tuple[str, str]:
    """(term, name): rank tensor `name` equals itself with [start, end) taken from `owner`."""
    name, shape = rank_name(piece), shapes[rank_name(piece)]
    lo, hi = _local(piece, start, end)
    parts, sizes = [], []
    if lo > 0:
        parts.append(f"(slice {leaf(name)} {dim} 0 {lo})")
        sizes.append(lo)
    parts.append(_slice(rank_name(owner), dim, *_local(owner, start, end), shapes[rank_name(owner)]))
    sizes.append(hi - lo)
    if hi < shape[dim]:
        parts.append(f"(slice {leaf(name)} {dim} {hi} {shape[dim]})")
        sizes.append(shape[dim] - hi)
    return concat_terms(parts, sizes, dim), name


def held_values(placements: dict[str, Placement], ref_values: dict[str, torch.Tensor],
                rank_shapes: dict[str, Shape]) -> dict[str, torch.Tensor]:
    """The rank tensors Custom placements fill, from the reference values (zeros elsewhere, e.g.
    padding), by distributed graph name."""
    held: dict[str, torch.Tensor] = {}
    for target, placement in placements.items():
        if not isinstance(placement, Custom):
            continue
        value = ref_values[target]
        dim = placement.dim % value.dim()
        for piece in placement.pieces:
            name = rank_name(piece)
            if name not in held:
                held[name] = torch.zeros(rank_shapes[name], dtype=value.dtype)
            held[name].narrow(dim, piece.local_start, piece.size).copy_(
                value.narrow(dim, piece.ref_start, piece.size))
    return held
