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


def _spans(placement: Custom, size: int, preferred: int = 0) -> list[tuple[int, int, Piece]]:
    """The dim cut at every piece boundary: (start, end, the piece covering it, rank `preferred`'s
    if it holds one, else the lowest rank's)."""
    cuts = sorted({0, size, *(p.ref_start for p in placement.pieces),
                   *(p.ref_start + p.size for p in placement.pieces)})
    order = sorted(placement.pieces, key=lambda p: (p.rank != preferred, p.rank, p.local, p.local_start))
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


def family_custom_relation(placement: Custom, ref_shape: Shape, local: str, local_shape: Shape,
                           world: int) -> Relation:
    """The relation of an even-block Custom placement over a rank family whose tensor `local`
    holds the blocks: block by block, the family's concatenation of each rank's block."""
    _, blocks = placement.even_blocks(world)
    dim = placement.dim % len(ref_shape)
    terms = [f"(rcat {_slice(local, dim, start, start + size, local_shape)} {dim} {size})"
             for start, size in blocks]
    return Relation(concat_terms(terms, [size * world for _, size in blocks], dim))


def _piece_shapes(target: str, placement: Custom, ref_shape: Shape, name_of: Callable[[Piece], str],
                  shape_of: Callable[[str], Shape | None]) -> dict[str, Shape]:
    """The shape of every rank tensor holding a piece, checked to hold it (tiling checked too)."""
    check_tiling(target, placement, ref_shape)
    dim = placement.dim % len(ref_shape)
    shapes = {}
    for piece in placement.pieces:
        name = name_of(piece)
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
    return shapes


def _owners_term(spans: list[tuple[int, int, Piece]], dim: int, name_of: Callable[[Piece], str],
                 shapes: dict[str, Shape]) -> str:
    """The concat of the owners' slices (one nested concat per run of one rank tensor's slices,
    as that rank's own split of it reads)."""
    runs: list[list[tuple[int, int, Piece]]] = []  # consecutive spans of one rank tensor
    for span in spans:
        if runs and name_of(runs[-1][-1][2]) == name_of(span[2]):
            runs[-1].append(span)
        else:
            runs.append([span])
    terms = [concat_terms([_slice(name_of(owner), dim, *_local(owner, start, end),
                                  shapes[name_of(owner)]) for start, end, owner in run],
                          [end - start for start, end, _ in run], dim) for run in runs]
    return concat_terms(terms, [run[-1][1] - run[0][0] for run in runs], dim)


def custom_relation(target: str, placement: Custom, ref_shape: Shape,
                    shape_of: Callable[[str], Shape | None]) -> Relation:
    """ref = concat of the owners' slices; every other piece is a replica of its owner's slice,
    stated as a fact: its rank tensor equals itself with that slice replaced by the owner's."""
    shapes = _piece_shapes(target, placement, ref_shape, rank_name, shape_of)
    dim = placement.dim % len(ref_shape)
    spans = _spans(placement, ref_shape[dim])
    facts = []
    for piece in placement.pieces:
        for start, end, owner in spans:
            lo, hi = max(start, piece.ref_start), min(end, piece.ref_start + piece.size)
            if piece == owner or lo >= hi:
                continue
            facts.append(_replica_fact(piece, owner, lo, hi, dim, shapes))
    return Relation(_owners_term(spans, dim, rank_name, shapes), tuple(dict.fromkeys(facts)))


def custom_output_terms(placement: Custom, ref_shape: Shape, rank_outputs: list[str],
                        rank_shapes: list[Shape]) -> list[str]:
    """Terms a reference output must equal when rank r's output `rank_outputs[r]` holds rank r's
    pieces (a gradient, laid out as its parameter): one per rank, taking every span that rank
    holds from it, so each replica is checked, not only the lowest rank's."""
    shape_of = dict(zip(rank_outputs, map(tuple, rank_shapes))).get

    def name_of(piece: Piece) -> str:
        return rank_outputs[piece.rank]

    shapes = _piece_shapes("output", placement, ref_shape, name_of, shape_of)
    dim = placement.dim % len(ref_shape)
    ranks = sorted({p.rank for p in placement.pieces})
    return list(dict.fromkeys(_owners_term(_spans(placement, ref_shape[dim], rank), dim, name_of,
                                           shapes) for rank in ranks))


def custom_output_values(placement: Custom, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference-shaped values `custom_output_terms` states, from rank r's output `outputs[r]`."""
    dim = placement.dim % outputs[0].dim()
    size = max(p.ref_start + p.size for p in placement.pieces)
    values = []
    for rank in sorted({p.rank for p in placement.pieces}):
        parts = [outputs[owner.rank].narrow(dim, _local(owner, start, end)[0], end - start)
                 for start, end, owner in _spans(placement, size, rank)]
        values.append(torch.cat(parts, dim))
    return values


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
            if name not in rank_shapes:  # (a rank not asked for)
                continue
            if name not in held:
                held[name] = torch.zeros(rank_shapes[name], dtype=value.dtype)
            held[name].narrow(dim, piece.local_start, piece.size).copy_(
                value.narrow(dim, piece.ref_start, piece.size))
    return held
