"""Writes into views (`buf[:, s:e] = x`, `cache[i].copy_(k)`, `out.t()[1:3] = 0`): the base's
new value as the untouched blocks of the old one around the written block.

The tracer turns every write into a view into `aten.as_strided_scatter(base, view, size, stride,
offset)`; this lowers it when the view is a block of a dense row-major base (a slice or an index
along any dims, in any dim order, or a contiguous reshape of whole rows), or of the base with
adjacent dims merged (a slot range across a paged cache's blocks), and refuses (so the value is
opaque) otherwise.
"""
from __future__ import annotations

from math import prod
from typing import Any

from ..errors import CaptureError
from .aten import Result, lowering
from .builder import GraphBuilder, Ref
from .strided import row_major, view_block


@lowering("as_strided_scatter")
def _as_strided_scatter(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    base, src, size, stride = args[0], args[1], list(args[2]), list(args[3])
    offset = args[4] if len(args) > 4 else kwargs.get("storage_offset")
    base_stride, base_offset = kwargs["input_layout"]
    if list(base_stride) != row_major(base.shape):
        raise CaptureError("aten.as_strided_scatter into a base that is not dense and row-major")
    offset = (offset or base_offset) - base_offset
    try:
        shape, starts, dims = view_block(base.shape, size, stride, offset, name)
    except CaptureError:
        if any(step != dense for extent, step, dense in zip(size, stride, row_major(size))
               if extent > 1):
            raise
        starts, rows = _rows(base.shape, offset, prod(size))
        return _written(b, base, b.reshape(src, rows), starts, 0)
    block = _as_block(b, src, size, dims, len(shape))
    return b.reshape(_written(b, b.reshape(base, shape), block, starts, 0), base.shape)


def _rows(shape: tuple[int, ...], offset: int, count: int) -> tuple[list[int], tuple[int, ...]]:
    """A contiguous view of another shape (`buf.view(s, b, h)` of a `[s*b, h]` base) written at
    `offset`: the block of whole rows of one base dim it covers, as the first index of each base
    dim and the block's shape; a CaptureError if it covers no such block."""
    for dim in range(len(shape)):
        inner = prod(shape[dim + 1:])
        if offset % inner or count % inner:
            continue
        first, rows = offset // inner, count // inner
        if first % shape[dim] + rows > shape[dim]:
            continue
        starts = []
        for extent in reversed(shape[:dim + 1]):
            starts.insert(0, first % extent)
            first //= extent
        block = (1,) * dim + (rows,) + tuple(shape[dim + 1:])
        return starts + [0] * (len(shape) - dim - 1), block
    raise CaptureError("aten.as_strided_scatter of a view that is not a block of its base")


def _as_block(b: GraphBuilder, src: Ref, size: list[int], dims: list[int | None], rank: int) -> Ref:
    """`src` laid out as the block: unit dims dropped, the rest in base-dim order, a unit dim
    for every base dim the view indexes."""
    for position in reversed(range(len(size))):
        if dims[position] is None:
            src = b.emit("squeeze", [src], dim=position)
    kept = [d for d in dims if d is not None]
    order = sorted(range(len(kept)), key=kept.__getitem__)
    src = b.permute(src, order) if order != list(range(len(kept))) else src
    for dim in range(rank):
        if dim not in kept:
            src = b.emit("unsqueeze", [src], dim=dim)
    return src


def _written(b: GraphBuilder, base: Ref, block: Ref, starts: list[int], dim: int) -> Ref:
    """`base` with `block` written at `starts`, from `dim` inwards."""
    if dim == len(base.shape):
        return block
    start, extent, whole = starts[dim], block.shape[dim], base.shape[dim]
    if (start, extent) == (0, whole):
        if block.shape == base.shape:
            return block
        return _written(b, base, block, starts, dim + 1)
    middle = _slice(b, base, dim, start, start + extent)
    pieces = [_written(b, middle, block, starts, dim + 1)]
    if start > 0:
        pieces.insert(0, _slice(b, base, dim, 0, start))
    if start + extent < whole:
        pieces.append(_slice(b, base, dim, start + extent, whole))
    return b.concat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _slice(b: GraphBuilder, x: Ref, dim: int, start: int, end: int) -> Ref:
    """x[start:end] along `dim`, taken from the pieces where x is a concat along `dim` (a buffer
    written block by block then holds only what was written, nothing of its old memory)."""
    if (start, end) == (0, x.shape[dim]):
        return x
    node = b.graph[x.name]
    if node.op != "concat" or node.attr("dim") != dim:
        return b.emit("slice", [x], dim=dim, start=start, end=end)
    taken, offset = [], 0
    for name in node.inputs:
        piece = b.graph[name]
        piece_ref, size = Ref(name, piece.shape, piece.dtype), piece.shape[dim]
        low, high = max(start, offset), min(end, offset + size)
        if low < high:
            taken.append(_slice(b, piece_ref, dim, low - offset, high - offset))
        offset += size
    return b.concat(taken, dim) if len(taken) > 1 else taken[0]
