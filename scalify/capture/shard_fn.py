"""Relations from a checkpoint sharding function `shard(reference_state, rank, world_size)`.

The function runs, once per rank, on integer index tensors of the reference parameters' shapes
(every element holds its own global index) under a dispatch mode that admits only data movement
and remembers, per tensor, the line of the last op that cut it (slice, select, index, split).
Each returned rank tensor is then read back as a concatenation, along one dim, of slices of
reference tensors (or as a stack of such along dim 0, slab by slab); inverted, that gives
every reference parameter's placement: Replicate or Shard when it is one (under the same
name), else Custom.
"""
from __future__ import annotations

import inspect
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError, ShapeError
from ..placements import SLAB, Custom, Piece, Placement, Replicate, Shard, slab_name
from ..verify.custom import check_tiling
from .shard_values import (Filler, Unfollowed, Value, ValueTracker, View, is_whole,
                           pieces_along, reference_value, slab)
from .tracer import SourceTracker

ShardFn = Callable[[dict[str, torch.Tensor], int, int], dict[str, torch.Tensor]]
Shape = tuple[int, ...]
# A reference this large is read only by following values: index tensors would take 8 bytes
# an element, twice over
MOST_INDEXED_ELEMENTS = 1 << 28

CUTS = frozenset({"slice", "select", "index", "index_select", "split", "split_with_sizes",
                  "unbind", "narrow", "gather", "take"})
MOVES = frozenset({"view", "_unsafe_view", "reshape", "clone", "contiguous", "alias", "detach",
                   "cat", "stack", "t", "transpose", "permute", "expand", "repeat",
                   "repeat_interleave", "unsqueeze", "squeeze", "flatten", "unflatten",
                   "_to_copy", "to", "copy_", "copy", "lift_fresh", "empty", "empty_like",
                   "zeros", "zeros_like", "new_zeros", "new_empty", "full", "fill_", "zero_",
                   "arange", "_reshape_alias", "as_strided", "movedim", "chunk", "flip"})


class _IndexMode(TorchDispatchMode):
    """Runs data-movement ops on index tensors (dtype and device changes ignored, new tensors
    zero: filler), or on meta tensors whose values `values` follows, and records where each
    result was last cut."""

    def __init__(self, values: ValueTracker | None = None) -> None:
        super().__init__()
        self.sources = SourceTracker({})
        self.cut_at: dict[int, tuple[torch.Tensor, str]] = {}
        self.values = values

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = func.overloadpacket.__name__
        where = self.sources.current()
        if name not in CUTS | MOVES:
            raise CaptureError(f"aten.{name} at {where} ({where.code}) is not data movement: a "
                               "sharding function may only slice, index, concatenate, reshape "
                               "and repeat reference tensors")
        if name in ("_to_copy", "to"):
            kwargs.pop("dtype", None)
            kwargs.pop("device", None)
        out = func(*args, **kwargs)
        if name in ("empty", "empty_like", "new_empty"):
            out.zero_()  # uninitialised integers could pass for reference indices
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        origin = str(where) if name in CUTS else next(
            (self.cut_at[id(a)][1] for a in inputs if id(a) in self.cut_at), "")
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and origin:
                self.cut_at[id(tensor)] = (tensor, origin)
        if self.values is not None:
            self.values.track(name, args, kwargs, out)
        return out

    def origin(self, tensor: torch.Tensor) -> str:
        entry = self.cut_at.get(id(tensor))
        return entry[1] if entry else ""


@dataclass
class _Indexed:
    """Reference tensors as index blocks: element i of `names[k]` holds `starts[k] + i`."""

    names: list[str]
    shapes: list[Shape]
    starts: list[int]
    _grids: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> _Indexed:
        names, shapes, starts, next_start = [], [], [], 1  # 0 marks filler (padding)
        for name, tensor in state.items():
            names.append(name)
            shapes.append(tuple(tensor.shape))
            starts.append(next_start)
            next_start += tensor.numel()
        return cls(names, shapes, starts)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.grid(k).clone() for k, name in enumerate(self.names)}

    def meta_tensors(self, values: ValueTracker) -> dict[str, torch.Tensor]:
        """Meta tensors of the references' shapes, each followed as its reference."""
        tensors = {}
        for k, name in enumerate(self.names):
            tensors[name] = torch.empty(self.shapes[k], dtype=torch.int64, device="meta")
            values.set(tensors[name], reference_value(k, self.shapes[k]))
        return tensors

    def numel(self) -> int:
        return sum(_numel(shape) for shape in self.shapes)

    def grid(self, k: int, dim: int = 0) -> torch.Tensor:
        """Reference tensor `k`'s indices, with `dim` moved first."""
        if (k, dim) not in self._grids:
            shape, start = self.shapes[k], self.starts[k]
            grid = torch.arange(start, start + _numel(shape)).reshape(shape)
            self._grids[k, dim] = grid.movedim(dim, 0) if shape else grid
        return self._grids[k, dim]

    def locate(self, index: int) -> tuple[int, tuple[int, ...]] | None:
        """(which reference tensor, coordinates) of a global index, or None for filler."""
        k = bisect_right(self.starts, index) - 1
        if k < 0 or index >= self.starts[k] + _numel(self.shapes[k]):
            return None
        coords, offset = [], index - self.starts[k]
        for size in reversed(self.shapes[k]):
            coords.append(offset % size)
            offset //= size
        return k, tuple(reversed(coords))


def _numel(shape: Shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass(frozen=True)
class _Found:
    """A piece of reference tensor `ref` along `dim` (None: the whole tensor, any dim)."""

    ref: str
    dim: int | None
    piece: Piece
    origin: str


def _read(indexed: _Indexed, rank: int, local: str, value: torch.Tensor, origin: str) -> list[_Found]:
    """The pieces a rank tensor is made of, trying each dim it could be cut along."""
    flat = value.reshape(-1)
    first = indexed.locate(int(flat[0])) if flat.numel() else None
    if first is not None and indexed.shapes[first[0]] == tuple(value.shape):
        k = first[0]
        if torch.equal(value, indexed.grid(k)):
            return [_Found(indexed.names[k], None, Piece(rank, local, 0, 0, value.shape[0] if
                                                         value.dim() else 1), origin)]
    for dim in range(value.dim()):
        found = _read_along(indexed, rank, local, value, dim, origin)
        if found is not None:
            return found
    if value.dim() > 1 and SLAB not in local:  # stacked from pieces (experts' weights)
        try:
            return [item for j in range(value.shape[0])
                    for item in _read(indexed, rank, slab_name(local, j), value[j], origin)]
        except ShapeError:
            pass
    raise _not_sliced(rank, local, tuple(value.shape), origin)


def _read_along(indexed: _Indexed, rank: int, local: str, value: torch.Tensor, dim: int,
                origin: str) -> list[_Found] | None:
    rows = value.movedim(dim, 0).reshape(value.shape[dim], -1)
    found: list[_Found] = []
    for i in range(rows.shape[0]):
        located = indexed.locate(int(rows[i, 0]))
        if located is None:
            if any(indexed.locate(int(x)) for x in rows[i].unique()):
                return None
            continue  # filler row (padding)
        k, coords = located
        shape = indexed.shapes[k]
        if len(shape) != value.dim() or any(c for d, c in enumerate(coords) if d != dim) or \
                any(s != shape[d] for d, s in enumerate(value.shape) if d != dim):
            return None
        ref_row = coords[dim] if shape else 0
        if not torch.equal(rows[i], indexed.grid(k, dim)[ref_row].reshape(-1)):
            return None
        _add_run(found, _Found(indexed.names[k], dim, Piece(rank, local, i, ref_row, 1), origin))
    return found


def _add_run(found: list[_Found], item: _Found) -> None:
    """Append `item`, extending the last piece when it continues it."""
    last = found[-1].piece if found else None
    piece = item.piece
    if (last and found[-1].ref == item.ref and last.local_start + last.size == piece.local_start
            and last.ref_start + last.size == piece.ref_start):
        found[-1] = _Found(item.ref, item.dim, Piece(piece.rank, piece.local, last.local_start,
                                                     last.ref_start, last.size + piece.size),
                           item.origin)
    else:
        found.append(item)


def _read_value(indexed: _Indexed, rank: int, local: str, value: Value, origin: str) -> list[_Found]:
    """`_read` on a followed value."""
    shape = value.shape
    if isinstance(value, View) and is_whole(value, indexed.shapes[value.ref]):
        return [_Found(indexed.names[value.ref], None,
                       Piece(rank, local, 0, 0, shape[0] if shape else 1), origin)]
    for dim in range(len(shape)):
        runs = pieces_along(value, dim, indexed.shapes)
        if runs is None:
            continue
        found: list[_Found] = []
        local_start = 0
        for ref, ref_start, size in runs:
            if ref is not None and size:
                _add_run(found, _Found(indexed.names[ref], dim,
                                       Piece(rank, local, local_start, ref_start, size), origin))
            local_start += size
        return found
    if len(shape) > 1 and SLAB not in local and not isinstance(value, Filler):
        try:
            return [item for j in range(shape[0])
                    for item in _read_value(indexed, rank, slab_name(local, j), slab(value, j),
                                            origin)]
        except (ShapeError, Unfollowed):
            pass
    raise _not_sliced(rank, local, shape, origin)


def _not_sliced(rank: int, local: str, shape: Shape, origin: str) -> ShapeError:
    return ShapeError(f"rank {rank}'s {local} (shape {list(shape)}, cut at {origin or '?'}) "
                      "is not a concatenation of slices of reference tensors along one dim, nor "
                      "a stack of such")


def infer_placements(shard_fn: ShardFn, reference_state: dict[str, torch.Tensor],
                     world_size: int, unmapped: set[str] = frozenset()) -> dict[str, Placement]:
    """Each reference tensor's placement, read from what `shard_fn` gives every rank.

    `reference_state` maps names to tensors of the reference's shapes (meta is fine: only
    shapes are read). Raises ShapeError when a reference tensor is not tiled by the ranks'
    pieces (the message names it and the gap) or a rank tensor is not made of slices; a
    tensor named in `unmapped` (a buffer the ranks build themselves, such as a rotary table)
    that the function gives no rank keeps the default, Replicate.
    """
    indexed = _Indexed.of(reference_state)
    try:
        found, local_shapes = _pieces(shard_fn, indexed, world_size, followed=True)
    except (Unfollowed, RuntimeError, NotImplementedError) as reason:
        if indexed.numel() > MOST_INDEXED_ELEMENTS:
            raise ShapeError(f"the sharding function {_defined_at(shard_fn) or ''} does what "
                             f"Scalify cannot follow on meta tensors ({reason}), and the "
                             f"reference, {indexed.numel():,} elements, is too large to read it "
                             "on index tensors: slice, concatenate, stack and reshape") from None
        found, local_shapes = _pieces(shard_fn, indexed, world_size, followed=False)
    return {name: _placement(name, shape, found[name], local_shapes, world_size)
            for name, shape in zip(indexed.names, indexed.shapes)
            if found[name] or name not in unmapped}


def _pieces(shard_fn: ShardFn, indexed: _Indexed, world_size: int, followed: bool
            ) -> tuple[dict[str, list[_Found]], dict[tuple[int, str], Shape]]:
    """Every reference tensor's pieces and every rank tensor's shape, the function run on
    meta tensors whose values are followed (shard_values.py) or on index tensors."""
    found: dict[str, list[_Found]] = {name: [] for name in indexed.names}
    local_shapes: dict[tuple[int, str], Shape] = {}
    defined_at = _defined_at(shard_fn)
    for rank in range(world_size):
        values = ValueTracker() if followed else None
        mode = _IndexMode(values)
        tensors = indexed.meta_tensors(values) if values else indexed.tensors()
        with mode:
            rank_state = shard_fn(tensors, rank, world_size)
        for local, value in rank_state.items():
            if not isinstance(value, torch.Tensor):
                raise CaptureError(f"the sharding function gave rank {rank} a {type(value).__name__}"
                                   f" for {local}, not a tensor")
            local_shapes[rank, local] = tuple(value.shape)
            origin = mode.origin(value) or defined_at
            items = (_read_value(indexed, rank, local, values.value(value), origin) if values
                     else _read(indexed, rank, local, value, origin))
            for item in items:
                found[item.ref].append(item)
                if item.piece.local != local:  # a slab
                    local_shapes[rank, item.piece.local] = tuple(value.shape[1:])
    return found, local_shapes


def stated_placements(reference: torch.nn.Module, world_size: int,
                      param_placements: dict[str, Placement] | None,
                      shard_fn: ShardFn | None) -> dict[str, Placement]:
    """The parameters' placements: `param_placements` over those `shard_fn` implies."""
    if shard_fn is None:
        return dict(param_placements or {})
    parameters = dict(reference.named_parameters(remove_duplicate=False))
    buffers = dict(reference.named_buffers())
    placements = infer_placements(shard_fn, {**parameters, **buffers}, world_size,
                                  unmapped=set(buffers) - set(parameters))
    return {**placements, **(param_placements or {})}


def _defined_at(shard_fn: Callable) -> str:
    """`file:line` of the function (through functools.partial)."""
    function = inspect.unwrap(getattr(shard_fn, "func", shard_fn))
    try:
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    except (OSError, TypeError):
        return ""


def _placement(name: str, shape: Shape, found: list[_Found],
               local_shapes: dict[tuple[int, str], Shape], world: int) -> Placement:
    if not found:
        raise ShapeError(f"{name}: the sharding function gives no rank any part of it")
    declared_at = found[0].origin
    dims = {item.dim for item in found if item.dim is not None}
    if len(dims) > 1:
        raise ShapeError(f"{name}: the ranks hold pieces cut along dims {sorted(dims)}; a "
                         "relation is read along one dim")
    dim = dims.pop() if dims else 0
    pieces = tuple(_along(item, dim, shape) for item in found)
    custom = Custom(dim, pieces, declared_at=declared_at)
    check_tiling(name, custom, shape)
    simple = _simple(name, dim, pieces, shape, local_shapes, world, declared_at)
    return simple or custom


def _along(item: _Found, dim: int, shape: Shape) -> Piece:
    """A whole-tensor piece restated along `dim`."""
    if item.dim is not None or not shape:
        return item.piece
    return Piece(item.piece.rank, item.piece.local, 0, 0, shape[dim])


def _simple(name: str, dim: int, pieces: tuple[Piece, ...], shape: Shape,
            local_shapes: dict[tuple[int, str], Shape], world: int,
            declared_at: str) -> Placement | None:
    """Replicate or Shard when the pieces are exactly one of those, under the same name."""
    if any(p.local != name for p in pieces) or not shape:
        return None if any(p.local != name for p in pieces) else Replicate(declared_at=declared_at)
    size = shape[dim]
    held = {(r, name): local_shapes.get((r, name)) for r in range(world)}
    if all(s == shape for s in held.values()) and set(pieces) == {
            Piece(r, name, 0, 0, size) for r in range(world)}:
        return Replicate(declared_at=declared_at)
    first = sorted((p for p in pieces if p.rank == 0), key=lambda p: p.local_start)
    if not first or size % first[0].size or len({p.size for p in pieces}) != 1:
        return None
    piece, blocks = first[0].size, len(first)
    count = size // (piece * blocks)
    if count * piece * blocks != size:
        return None
    chunks = []
    for rank in range(world):
        starts = sorted(p.ref_start for p in pieces if p.rank == rank)
        chunks.append(starts[0] // piece if starts else -1)
    candidate = Shard(dim, blocks, None if chunks == list(range(world)) else tuple(chunks),
                      declared_at=declared_at)
    expected = {Piece(r, name, b * piece, b * count * piece + c * piece, piece)
                for r, c in enumerate(chunks) for b in range(blocks)}
    return candidate if expected == set(pieces) else None
