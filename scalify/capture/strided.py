"""Where a strided view lies in a dense row-major tensor: a block of it, or of it with adjacent
dims merged. Reads (`as_strided`) and writes (`as_strided_scatter`) of such views lower to
slices and concats instead of a walk through flat memory."""
from __future__ import annotations

from ..errors import CaptureError


def row_major(shape: tuple[int, ...] | list[int]) -> list[int]:
    """The strides of a dense tensor of `shape`, last dim fastest."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.insert(0, step)
        step *= extent
    return strides


def view_block(shape: tuple[int, ...], size: list[int], stride: list[int], offset: int,
               op: str) -> tuple[tuple[int, ...], list[int], list[int | None]]:
    """The view (`size`, `stride`, `offset` into a row-major tensor of `shape`) as a block: the
    tensor's shape with the dims merged that the view runs across, the block's first index in
    each of its dims, and each view dim's dim in it (None for a unit dim). A CaptureError
    naming `op` if the view is not a block of any such shape."""
    merged = _merged(shape, size, stride, offset)
    return (merged, *_block(merged, size, stride, offset, op))


def _merged(shape: tuple[int, ...], size: list[int], stride: list[int],
            offset: int) -> tuple[int, ...]:
    """`shape` with adjacent dims merged where a view dim runs past the end of its dim (slots
    3 to 6 of a paged cache [blocks, block_size, ...] cross a block boundary: they are a block
    of [blocks * block_size, ...]); unchanged if the view is a block of it already."""
    shape = list(shape)
    merging = True
    while merging:
        merging = False
        strides = row_major(shape)
        for extent, step in zip(size, stride):
            if extent > 1 and step in strides:
                dim = strides.index(step)
                if dim > 0 and (offset // step) % shape[dim] + extent > shape[dim]:
                    shape[dim - 1:dim + 1] = [shape[dim - 1] * shape[dim]]
                    merging = True
                    break
    return tuple(shape)


def _block(shape: tuple[int, ...], size: list[int], stride: list[int], offset: int,
           op: str) -> tuple[list[int], list[int | None]]:
    """Each dim's first index and each view dim's dim, if the view is a block of `shape`."""
    strides = row_major(shape)
    dims: list[int | None] = []
    for extent, step in zip(size, stride):
        candidates = [d for d in range(len(shape)) if strides[d] == step and shape[d] >= extent]
        dims.append(None if extent == 1 else (candidates[0] if candidates else -1))
    taken = [d for d in dims if d is not None]
    not_a_block = CaptureError(f"aten.{op} of a view that is not a block of its base")
    if -1 in taken or len(set(taken)) != len(taken):
        raise not_a_block
    starts, left = [], offset
    for d, step in enumerate(strides):
        starts.append(left // step)
        left -= starts[-1] * step
        extent = size[dims.index(d)] if d in dims else 1
        if starts[-1] + extent > shape[d]:
            raise not_a_block
    return starts, dims
