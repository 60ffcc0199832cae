"""A data-movement term that lays a source tensor's elements out as an index map says.

`layout_term(source, shape, where)` answers: which chain of splits, slices, transposes,
broadcasts and merges of `source` (of `shape`) holds, at every position, the source element
whose row-major index `where` gives there? Such a chain exists when the map is affine in the
mixed-radix digits of the position (each digit moves the source index by a fixed stride, zero for
a broadcast) and the strides nest inside the source; otherwise there is none (None). The chain is
checked by evaluating it on the source's indices, so a term returned is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from ..ir.ops import infer_shape
from ..rules.terms import App, evaluate

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Digit:
    """One mixed-radix digit of a position: its range, the source stride it moves, and the
    output dim it belongs to."""

    size: int
    stride: int
    dim: int


def layout_term(source: App, shape: Shape, where: torch.Tensor) -> App | None:
    """A movement term over `source` (of `shape`) whose entries are the source elements at the
    row-major indices `where` (of the term's shape), or None when no such chain exists."""
    flat = where.reshape(-1)
    if prod(shape) == 1:
        built = _broadcast_one(shape, tuple(where.shape))
    else:
        digits = _digits(flat, tuple(where.shape))
        built = None if digits is None else _Builder(shape).lay_out(digits, int(flat[0]),
                                                                     tuple(where.shape))
    if built is None:
        return None
    ids = torch.arange(prod(shape), dtype=torch.int64).reshape(shape)
    try:
        value = evaluate(built, {"source": ids})
    except ValueError:
        return None
    if tuple(value.shape) != tuple(where.shape) or not torch.equal(value, where):
        return None
    return _rebind(built, source)


def _broadcast_one(shape: Shape, target: Shape) -> App:
    """The one element of a source of `shape` broadcast to `target`."""
    term: App | str = "?source"
    for _ in shape:
        term = App("squeeze", (term, 0))
    for dim, size in enumerate(target):
        term = App("unsqueeze", (term, dim))
        if size != 1:
            term = App("expand", (term, dim, size))
    return term


def _digits(flat: torch.Tensor, shape: Shape) -> list[_Digit] | None:
    """The position's digits, outermost first, with `flat` affine in them; None if it is not."""
    digits: list[_Digit] = []
    inner = 1
    for dim in reversed(range(len(shape))):
        steps = flat[torch.arange(shape[dim]) * inner] - flat[0]
        found = _factor(steps.tolist())
        if found is None:
            return None
        digits = [_Digit(size, stride, dim) for size, stride in found] + digits
        inner *= shape[dim]
    offset = int(flat[0])
    rebuilt = torch.full((1,), offset, dtype=torch.int64)
    for digit in digits:
        rebuilt = (rebuilt.unsqueeze(-1) + torch.arange(digit.size) * digit.stride).reshape(-1)
    return digits if torch.equal(rebuilt, flat) else None


def _factor(steps: list[int]) -> list[tuple[int, int]] | None:
    """(size, stride) digits, outermost first, of one dim whose entries move the source index
    by `steps` (steps[0] == 0)."""
    n = len(steps)
    if n == 1:
        return []
    stride = steps[1]
    run = next((t for t in range(1, n) if steps[t] != t * stride), n)
    if n % run:
        return None
    if any(steps[t] != steps[t - t % run] + (t % run) * stride for t in range(n)):
        return None
    outer = _factor(steps[::run])
    return None if outer is None else outer + [(run, stride)]


class _Builder:
    """Builds the chain over the variable `?source`, tracking the current shape."""

    def __init__(self, shape: Shape) -> None:
        self.term: App | str = "?source"
        self.shape = list(shape)

    def _apply(self, head: str, *args: int) -> None:
        self.term = App(head, (self.term, *args))
        self.shape = list(infer_shape(head, [tuple(self.shape)], dict(zip(_ATTRS[head], args))))

    def lay_out(self, digits: list[_Digit], offset: int, out_shape: Shape) -> App | str | None:
        """The chain for `digits` (outermost first) starting at source index `offset`."""
        moving = sorted((d for d in digits if d.stride), key=lambda d: -d.stride)
        if len({d.stride for d in moving}) != len(moving) or any(d.stride < 0 for d in moving):
            return None  # (a reversal, or two digits moving alike)
        total = prod(self.shape)
        strides = [d.stride for d in moving] + [1]  # of each cut dim; the last is the unit dim
        bounds = [total] + strides[:-1]
        if any(bound % stride for bound, stride in zip(bounds, strides)):
            return None
        sizes = [bound // stride for bound, stride in zip(bounds, strides)]
        starts = [(offset // stride) % size for stride, size in zip(strides, sizes)]
        spans = [d.size for d in moving] + [1]
        if (sum(s * t for s, t in zip(starts, strides)) != offset
                or any(s + n > size for s, n, size in zip(starts, spans, sizes))):
            return None
        if not self._cut(sizes):
            return None
        for dim, (size, start, span) in enumerate(zip(sizes, starts, spans)):
            if size > 1 and (start, span) != (0, size):
                self._apply("slice", dim, start, start + span)
        if sizes[-1] > 1:  # the unit dim: one element of each stride's block
            self._apply("squeeze", len(sizes) - 1)
        in_order = [d for d in digits if d.stride]
        self._permute([moving.index(d) for d in in_order])
        for position, digit in enumerate(digits):
            if not digit.stride:
                self._apply("unsqueeze", position)
                self._apply("expand", position, digit.size)
        for dim in reversed(range(len(out_shape))):
            members = [i for i, d in enumerate(digits) if d.dim == dim]
            if not members:
                self._apply("unsqueeze", sum(d.dim < dim for d in digits))
            for position in reversed(members[:-1]):
                self._apply("merge", position, self.shape[position + 1])
        return self.term

    def _cut(self, sizes: list[int]) -> bool:
        """Split and merge the source's dims into dims of `sizes` (its flat index cut the same
        way); False when the two ways of cutting do not nest."""
        for dim in reversed(range(len(self.shape))):
            if self.shape[dim] == 1 and len(self.shape) > 1:
                self._apply("squeeze", dim)
        mine = _bounds(self.shape)
        wanted = _bounds([s for s in sizes if s > 1] or [1])
        common = sorted(set(mine) | set(wanted), reverse=True)
        if any(outer % inner for outer, inner in zip(common, common[1:])):
            return False
        dim = 0
        for outer, inner in zip(mine, mine[1:]):  # split each source dim at the common cuts
            cuts = [c for c in common if inner < c < outer]
            for cut in cuts:
                self._apply("split", dim, cut // inner)
                dim += 1
            dim += 1
        groups = []  # the common dims each wanted dim spans
        position = 0
        for outer, inner in zip(wanted, wanted[1:]):
            count = sum(inner <= c < outer for c in common[1:])
            groups.append((position, count))
            position += count
        for start, count in reversed(groups):
            for merged in reversed(range(start, start + count - 1)):
                self._apply("merge", merged, self.shape[merged + 1])
        return True

    def _permute(self, order: list[int]) -> None:
        """Transpose dims so that dim i holds what dim `order[i]` holds now."""
        current = list(range(len(order)))
        for i, wanted in enumerate(order):
            j = current.index(wanted)
            if j != i:
                self._apply("transpose", i, j)
                current[i], current[j] = current[j], current[i]


def _bounds(shape: list[int]) -> list[int]:
    """The flat-index strides that cut a row-major index into `shape`'s dims, outermost first,
    ending with 1."""
    return [prod(shape[i:]) for i in range(len(shape))] + [1]


_ATTRS = {"split": ("dim", "inner"), "merge": ("dim", "inner"), "slice": ("dim", "start", "end"),
          "squeeze": ("dim",), "unsqueeze": ("dim",), "expand": ("dim", "size"),
          "transpose": ("dim0", "dim1")}


def _rebind(term: App | str, source: App) -> App:
    if term == "?source":
        return source
    if not isinstance(term, App):
        return term
    return App(term.head, tuple(_rebind(a, source) for a in term.args))
