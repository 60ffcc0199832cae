"""What a sharding function's tensors hold, followed symbolically: for references too big to
index element by element (Llama-3.1-405B's embedding alone has 2.1 billion elements).

The function runs on meta tensors (shard_fn.py's dispatch mode) and every tensor's value is
followed as one of:
- `View`: elements of one reference tensor, at an element offset and strides among the
  reference's; torch's own view ops compute them, on a meta alias of the reference's storage;
- `Joined`: a concatenation of values along one dim (`cat`, `stack`);
- `Filler`: a new tensor (padding), no reference element.
Copies (`clone`, `contiguous`, dtype and device changes) keep the value. An op this cannot
follow (a gather by index, a reshape that splits a concatenated dim) raises `Unfollowed`, and
the caller reads index tensors instead (shard_fn.py), at the reference's size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Union

import torch
from torch.utils._pytree import tree_flatten

Shape = tuple[int, ...]

KEEPS = frozenset({"clone", "contiguous", "_to_copy", "to", "detach", "alias", "lift_fresh"})
FILLS = frozenset({"empty", "empty_like", "zeros", "zeros_like", "new_zeros", "new_empty",
                   "full", "fill_", "zero_"})
VIEWS = frozenset({"view", "_unsafe_view", "_reshape_alias", "reshape", "slice", "select",
                   "split", "split_with_sizes", "unbind", "t", "transpose", "permute",
                   "unsqueeze", "squeeze", "expand", "narrow", "movedim", "flatten",
                   "unflatten", "chunk"})
_MOST_OUTER_PARTS = 1 << 12  # a merge of a concatenated dim unrolls its outer dims


class Unfollowed(Exception):
    """An op whose result is not followed as a view, concatenation or fill."""


@dataclass(frozen=True, eq=False)
class View:
    """Elements of reference tensor `ref`: `alias` is a meta view of its contiguous storage."""

    ref: int
    alias: torch.Tensor

    @property
    def shape(self) -> Shape:
        return tuple(self.alias.shape)


@dataclass(frozen=True, eq=False)
class Joined:
    """`parts` concatenated along `dim`."""

    dim: int
    parts: tuple["Value", ...]
    shape: Shape


@dataclass(frozen=True)
class Filler:
    shape: Shape


Value = Union[View, Joined, Filler]


def reference_value(ref: int, shape: Shape) -> View:
    return View(ref, torch.empty(shape, device="meta"))


class ValueTracker:
    """Each tensor's value, by tensor identity (the tensors are held so ids stay unique)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[torch.Tensor, Value]] = {}
        # a slice or select's output -> (its input, dim, start, size, whether the dim is gone):
        # where a write into it lands
        self._cuts: dict[int, tuple[torch.Tensor, int, int, int, bool]] = {}
        # a view's storage root, and the root's count of writes when the view's value was set:
        # a view read after a later write into its root is not followed
        self._roots: dict[int, int] = {}
        self._writes: dict[int, int] = {}
        self._seen: dict[int, int] = {}

    def set(self, tensor: torch.Tensor, value: Value) -> None:
        self._values[id(tensor)] = (tensor, value)
        self._seen[id(tensor)] = self._writes.get(self._root(tensor), 0)

    def value(self, tensor: torch.Tensor) -> Value:
        entry = self._values.get(id(tensor))
        if entry is None:
            raise Unfollowed(f"a tensor of shape {list(tensor.shape)} the sharding function did "
                             "not derive from a reference tensor")
        if self._seen[id(tensor)] != self._writes.get(self._root(tensor), 0):
            raise Unfollowed("a view read after a write into the tensor it views")
        return entry[1]

    def _root(self, tensor: torch.Tensor) -> int:
        return self._roots.get(id(tensor), id(tensor))

    def track(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """Follow one dispatched op (`name`: its overload packet's name)."""
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in ("fill_", "zero_"):
            self._write(args[0], Filler(tuple(args[0].shape)))
            return
        if name in FILLS:
            for tensor in outputs:
                self.set(tensor, Filler(tuple(tensor.shape)))
            return
        if name in KEEPS:
            if name in ("alias", "detach"):
                self._roots[id(outputs[0])] = self._root(args[0])
            self.set(outputs[0], self.value(args[0]))
            return
        if name in ("copy_", "copy"):
            source = self.value(args[1])
            if source.shape != tuple(outputs[0].shape):
                raise Unfollowed(f"aten.{name} broadcasts")
            if name == "copy_":
                self._write(args[0], source)
            self.set(outputs[0], source)
            return
        if name in ("cat", "stack"):
            dim = _dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), outputs[0].dim())
            values = [self.value(t) for t in args[0] if name == "stack" or t.numel()]
            if name == "stack":
                values = [_unsqueezed(v, dim) for v in values]
            self.set(outputs[0], joined(dim, values, tuple(outputs[0].shape)))
            return
        if name in VIEWS:
            results = viewed(name, self.value(args[0]), args[1:], kwargs, outputs)
            for tensor, value in zip(outputs, results):
                self._roots[id(tensor)] = self._root(args[0])
                self.set(tensor, value)
            if name in ("slice", "select") and outputs[0].numel():
                self._remember_cut(name, args, outputs[0])
            return
        raise Unfollowed(f"aten.{name}")

    def _remember_cut(self, name: str, args: tuple, out: torch.Tensor) -> None:
        base = args[0]
        dim = _dim(args[1] if len(args) > 1 else 0, base.dim())
        if name == "select":
            start, size = args[2] % base.shape[dim], 1
        else:
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            start = max(0, start + base.shape[dim]) if start < 0 else min(start, base.shape[dim])
            if len(args) > 4 and args[4] != 1:
                return
            size = out.shape[dim]
        self._cuts[id(out)] = (base, dim, start, size, name == "select")

    def _write(self, target: torch.Tensor, value: Value) -> None:
        """`target` (and what it was cut from, through slices and selects) now holds `value`."""
        chain = [target]
        while id(chain[-1]) in self._cuts:
            chain.append(self._cuts[id(chain[-1])][0])
        wholes = [self.value(base) for base in chain[1:]]
        root = self._root(target)
        self._writes[root] = self._writes.get(root, 0) + 1
        self.set(target, value)
        for view, base, whole in zip(chain, chain[1:], wholes):
            _, dim, start, size, selected = self._cuts[id(view)]
            if selected:
                value = reshaped(value, value.shape[:dim] + (1,) + value.shape[dim:])
            end = whole.shape[dim]
            value = joined(dim, [cut(whole, dim, 0, start), value,
                                 cut(whole, dim, start + size, end - start - size)], whole.shape)
            self.set(base, value)


def joined(dim: int, values: list[Value], shape: Shape) -> Value:
    """`values` concatenated along `dim` (nested concatenations along it flattened)."""
    parts: list[Value] = []
    for value in values:
        if value.shape[dim]:
            parts.extend(value.parts if isinstance(value, Joined) and value.dim == dim else [value])
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, Filler) for part in parts):
        return Filler(shape)
    return Joined(dim, tuple(parts), shape)


def viewed(name: str, value: Value, args: tuple, kwargs: dict,
           outputs: list[torch.Tensor]) -> list[Value]:
    """The values of a view op's outputs (torch's `outputs`, in order, for their shapes)."""
    shapes = [tuple(t.shape) for t in outputs]
    if isinstance(value, Filler):
        return [Filler(shape) for shape in shapes]
    if isinstance(value, View):
        return _aliased(value, name, args, kwargs, shapes)
    rank = len(value.shape)
    arg = lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default)
    if name in ("slice", "narrow"):
        dim = _dim(arg(0, "dim", 0), rank)
        start = arg(1, "start", None) or 0
        start = max(0, start + value.shape[dim] if start < 0 else min(start, value.shape[dim]))
        if arg(3, "step", 1) != 1 and name == "slice":
            raise Unfollowed("aten.slice with a step, of a concatenation")
        return [cut(value, dim, start, shapes[0][dim])]
    if name == "select":
        dim = _dim(arg(0, "dim", 0), rank)
        index = arg(1, "index", 0) % value.shape[dim]
        return [reshaped(cut(value, dim, index, 1), shapes[0])]
    if name in ("split", "split_with_sizes", "unbind"):
        dim = _dim(arg(1, "dim", 0) if name != "unbind" else arg(0, "dim", 0), rank)
        results, start = [], 0
        for shape in shapes:
            size = shape[dim] if name != "unbind" else 1
            piece = cut(value, dim, start, size)
            results.append(reshaped(piece, shape) if name == "unbind" else piece)
            start += size
        return results
    if name in ("t", "transpose", "permute"):
        order = list(range(rank))
        if name == "permute":
            order = [_dim(d, rank) for d in arg(0, "dims", order)]
        elif rank > 1:
            a, b = (0, 1) if name == "t" else (_dim(args[0], rank), _dim(args[1], rank))
            order[a], order[b] = order[b], order[a]
        return [permuted(value, order)]
    if name == "expand" and shapes[0] == value.shape:
        return [value]
    if name in ("view", "_unsafe_view", "_reshape_alias", "reshape", "flatten", "unflatten",
                "unsqueeze", "squeeze"):
        return [reshaped(value, shapes[0])]
    raise Unfollowed(f"aten.{name} of a concatenation")


def _aliased(value: View, name: str, args: tuple, kwargs: dict, shapes: list[Shape]) -> list[Value]:
    """A view op applied to the meta alias: its offsets and strides are the results' elements."""
    try:
        result = getattr(torch.ops.aten, name)(value.alias, *args, **kwargs)
    except (RuntimeError, AttributeError) as error:
        raise Unfollowed(f"aten.{name}: {error}") from None
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if [tuple(r.shape) for r in results] != shapes or not all(
            _same_storage(r, value.alias) for r in results):
        raise Unfollowed(f"aten.{name} copies")
    return [View(value.ref, r) for r in results]


def cut(value: Value, dim: int, start: int, size: int) -> Value:
    """Indices [start, start + size) of `value` along `dim`."""
    shape = value.shape[:dim] + (size,) + value.shape[dim + 1:]
    if isinstance(value, Filler):
        return Filler(shape)
    if isinstance(value, View):
        return View(value.ref, value.alias.narrow(dim, start, size))
    if value.dim != dim:
        return Joined(value.dim, tuple(cut(p, dim, start, size) for p in value.parts), shape)
    kept, offset = [], 0
    for part in value.parts:
        length = part.shape[dim]
        low, high = max(start, offset), min(start + size, offset + length)
        if low < high:
            kept.append(cut(part, dim, low - offset, high - low))
        offset += length
    return joined(dim, kept, shape)


def permuted(value: Value, order: list[int]) -> Value:
    """`value` with its dims in `order` (result dim i is dim order[i])."""
    shape = tuple(value.shape[d] for d in order)
    if isinstance(value, Filler):
        return Filler(shape)
    if isinstance(value, View):
        return View(value.ref, value.alias.permute(order))
    return Joined(order.index(value.dim), tuple(permuted(p, order) for p in value.parts), shape)


def reshaped(value: Value, shape: Shape) -> Value:
    """`value` read in `shape` (row-major order, as `view` and `reshape` read it)."""
    shape = tuple(shape)
    if isinstance(value, Filler):
        return Filler(shape)
    if isinstance(value, View):
        try:
            return View(value.ref, value.alias.view(shape))
        except RuntimeError:
            raise Unfollowed("a reshape that copies a strided view") from None
    if shape == value.shape:
        return value
    old_dims, new_dims = _group_of(value.shape, shape, value.dim)
    outer = [d for d in old_dims if d < value.dim]
    if len(new_dims) != 1 and (len(old_dims) != 1 or
                               sum(shape[d] != 1 for d in new_dims) > 1):
        raise Unfollowed("a reshape that splits a concatenated dim")
    new_dim = new_dims[0] if len(new_dims) == 1 else next(
        (d for d in new_dims if shape[d] != 1), new_dims[-1])
    inner = math.prod(value.shape[d] for d in old_dims if d > value.dim)
    counts = [value.shape[d] for d in outer]
    if math.prod(counts) > _MOST_OUTER_PARTS:
        raise Unfollowed("a reshape that merges a concatenated dim under many outer rows")
    parts: list[Value] = []
    for index in product(*(range(n) for n in counts)):
        for part in value.parts:
            piece = part
            for d, i in zip(outer, index):  # (each cut keeps the dim, size 1)
                piece = cut(piece, d, i, 1)
            target = shape[:new_dim] + (part.shape[value.dim] * inner,) + shape[new_dim + 1:]
            parts.append(reshaped(piece, target))
    return joined(new_dim, parts, shape)


def _group_of(old: Shape, new: Shape, dim: int) -> tuple[list[int], list[int]]:
    """The old dims and the new dims a reshape maps onto each other (the least runs of equal
    size), for the run holding old dim `dim`."""
    i = j = 0
    while i < len(old):
        old_run, new_run, a, b = [], [], 1, 1
        while not (old_run and new_run and a == b):
            if i < len(old) and (a < b or not old_run or j >= len(new)):
                old_run.append(i)
                a *= old[i]
                i += 1
            elif j < len(new):
                new_run.append(j)
                b *= new[j]
                j += 1
            else:
                break
        if dim in old_run:
            return old_run, new_run
    raise Unfollowed("a reshape of a concatenation")


def pieces_along(value: Value, dim: int, reference_shapes: list[Shape]) -> list[tuple[int | None, int, int]] | None:
    """`value` along `dim` as runs (reference, its start along `dim`, size), each spanning the
    reference whole in every other dim (reference None: filler); None when it is not."""
    if isinstance(value, Filler):
        return [(None, 0, value.shape[dim])]
    if isinstance(value, Joined):
        if value.dim != dim:
            return None
        runs: list[tuple[int | None, int, int]] = []
        for part in value.parts:
            found = pieces_along(part, dim, reference_shapes)
            if found is None:
                return None
            runs.extend(found)
        return runs
    shape, alias = reference_shapes[value.ref], value.alias
    strides = _contiguous_strides(shape)
    if alias.dim() != len(shape) or any(alias.shape[d] != shape[d] for d in range(len(shape))
                                        if d != dim):
        return None
    if any(alias.stride(d) != strides[d] for d in range(len(shape)) if alias.shape[d] > 1):
        return None
    start, rest = divmod(alias.storage_offset(), strides[dim]) if shape else (0, 0)
    return [(value.ref, start, alias.shape[dim] if shape else 1)] if rest == 0 else None


def is_whole(value: Value, shape: Shape) -> bool:
    """Whether `value` is reference tensor `value.ref` (of `shape`) as it is."""
    return isinstance(value, View) and tuple(value.alias.shape) == shape and \
        value.alias.storage_offset() == 0 and all(
            value.alias.stride(d) == s for d, s in enumerate(_contiguous_strides(shape))
            if shape[d] > 1)


def slab(value: Value, index: int) -> Value:
    """Slab `index` along dim 0."""
    return reshaped(cut(value, 0, index, 1), value.shape[1:])


def _contiguous_strides(shape: Shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _unsqueezed(value: Value, dim: int) -> Value:
    return reshaped(value, value.shape[:dim] + (1,) + value.shape[dim:])
