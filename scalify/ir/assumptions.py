"""What the user assumes of integer inputs, applied to the programs before the proof.

Code differs where an input could take values no caller passes: PyTorch's cross-entropy skips
targets equal to its ignore index (-100), while a hand-written vocab-parallel loss counts every
target, so the two agree only for labels in [0, vocab). A user states that as an assumption, an
inclusive range per integer input (`{"labels": (0, vocab - 1)}`). Ranges are carried through
data movement and collectives that move data (a broadcast is a block of an all_gather); an
equality test with a constant outside the range becomes a constant, and a mask, condition or
factor that is then constant drops out (`masked_fill` with an all-false mask is its input). The
proof then holds for every input within the ranges, and the report says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch

from ..errors import ScalifyError
from .distributed import constant_values, match_collectives, qualified
from .graph import Graph, Node
from .simplify import with_aliases

# Ops whose output takes only values of their first input (data movement).
_MOVES_VALUES = frozenset({"merge", "split", "unsqueeze", "squeeze", "transpose", "expand",
                           "slice", "cast"})
# Whether x `op` value holds for every x in [low, high] (True), for none (False), or neither
# (None). Equality is decided by any range (an ignore index, a padding id outside it); orderings
# by intrinsic ranges only: under assumed ranges they are how shards mask ids, and the proof
# relates them as written.
_EQUALITIES: dict[str, Callable[[ValueRange, float], bool | None]] = {
    "eq_scalar": lambda r, v: False if not r.low <= v <= r.high else (True if r.low == r.high else None),
    "ne_scalar": lambda r, v: True if not r.low <= v <= r.high else (False if r.low == r.high else None),
}
_ORDERINGS: dict[str, Callable[[ValueRange, float], bool | None]] = {
    "lt_scalar": lambda r, v: True if r.high < v else (False if r.low >= v else None),
    "le_scalar": lambda r, v: True if r.high <= v else (False if r.low > v else None),
    "gt_scalar": lambda r, v: True if r.low > v else (False if r.high <= v else None),
    "ge_scalar": lambda r, v: True if r.low >= v else (False if r.high < v else None),
}


@dataclass(frozen=True)
class ValueRange:
    """An integer input's assumed values: low <= x <= high."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ScalifyError(f"an assumed range needs low <= high, got [{self.low}, {self.high}]")

    def union(self, other: "ValueRange") -> "ValueRange":
        return ValueRange(min(self.low, other.low), max(self.high, other.high))

    def __str__(self) -> str:
        return f"[{self.low}, {self.high}]"


def value_ranges(graphs: list[Graph], assumed: Mapping[str, ValueRange]) -> list[dict[str, ValueRange]]:
    """Each graph's integer and boolean nodes whose values the assumptions or the ops themselves
    bound (the graphs are one program's ranks, so an all_gather's range is the union of its
    members')."""
    ranges: list[dict[str, ValueRange]] = [{} for _ in graphs]
    partners: dict | None = None
    changed = True
    while changed:  # a gathered range is known once every member's input is
        changed = False
        for rank, graph in enumerate(graphs):
            known = ranges[rank]
            for node in graph:
                if node.name in known:
                    continue
                if node.op == "all_gather":
                    if partners is None:
                        partners = match_collectives(graphs) if len(graphs) > 1 else {}
                    found = _gathered(partners.get(qualified(rank, node.name)), ranges)
                else:
                    found = _range(node, graph, known, assumed)
                if found is not None:
                    known[node.name] = found
                    changed = True
    return ranges


def _range(node: Node, graph: Graph, known: dict[str, ValueRange],
           assumed: Mapping[str, ValueRange]) -> ValueRange | None:
    if node.op == "placeholder":
        return assumed.get(node.attr("target")) if node.attr("kind") == "input" else None
    if node.dtype == "bool":
        return ValueRange(0, 1)
    if not _integral(node.dtype):
        return None
    inputs = [known.get(i) for i in node.inputs]
    if node.op == "iota":
        last = node.attr("start") + node.attr("step") * (node.shape[0] - 1)
        return ValueRange(min(node.attr("start"), last), max(node.attr("start"), last))
    if node.op == "full" and isinstance(node.attr("value"), (int, bool)):
        return ValueRange(int(node.attr("value")), int(node.attr("value")))
    if node.op == "topk_index":
        return ValueRange(0, graph[node.inputs[0]].shape[-1] - 1)
    if node.op == "masked_fill":
        return _filled_range(node, graph, known)
    if not inputs or None in inputs:
        return None
    if node.op in _MOVES_VALUES or node.op == "concat":
        return _union(inputs)
    value = node.attr("value")
    if node.op == "add_scalar" and isinstance(value, int) and not isinstance(value, bool):
        return ValueRange(inputs[0].low + value, inputs[0].high + value)
    if node.op == "mul_scalar" and isinstance(value, int) and not isinstance(value, bool):
        return _spanned([inputs[0].low * value, inputs[0].high * value])
    if node.op == "add":
        return ValueRange(inputs[0].low + inputs[1].low, inputs[0].high + inputs[1].high)
    if node.op == "sub":
        return ValueRange(inputs[0].low - inputs[1].high, inputs[0].high - inputs[1].low)
    if node.op == "mul":
        return _product(*inputs)
    if node.op == "sum":
        return _times(inputs[0], _count(graph[node.inputs[0]].shape, node.shape))
    if node.op == "matmul":  # a sum of `inner` products
        return _times(_product(*inputs), graph[node.inputs[0]].shape[-1])
    return None


def _filled_range(node: Node, graph: Graph, known: dict[str, ValueRange]) -> ValueRange | None:
    """A fill's values: the fill value, and its input's where the mask is off, bounded by the
    mask's own tests where they test that input or the value it is shifted from (a shard's
    local ids, `ids - start` kept where `start <= ids < end`, lie in [0, end - start))."""
    value = node.attr("value")
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    source = graph[node.inputs[0]]
    bound = known.get(source.name)
    mask = graph[node.inputs[1]]
    tested = (_where(graph, mask.name, False) or {}) if mask.shape == node.shape else {}
    if source.name in tested:
        bound = _within(bound, tested[source.name])
    shift = source.attr("value")
    if (source.op == "add_scalar" and isinstance(shift, int) and not isinstance(shift, bool)
            and source.inputs[0] in tested):
        low, high = tested[source.inputs[0]]
        bound = _within(bound, (low + shift, high + shift))
    if bound is None:
        return None
    return bound.union(ValueRange(value, value))


def _within(bound: ValueRange | None, limits: tuple[float, float]) -> ValueRange | None:
    """`bound` (None: unbounded) within `limits`; an empty range as None too, which leaves the
    fill's range unknown (no position keeps its input, a case no rule needs)."""
    low = limits[0] if bound is None else max(bound.low, limits[0])
    high = limits[1] if bound is None else min(bound.high, limits[1])
    bounded = abs(low) != _UNBOUNDED != abs(high) and low <= high
    return ValueRange(int(low), int(high)) if bounded else None


_UNBOUNDED = float("inf")


def _where(graph: Graph, name: str, truth: bool) -> dict[str, tuple[float, float]] | None:
    """Bounds on the tested values wherever boolean node `name` is `truth`, by the integer
    comparisons it is made of (`(ids < s) | (ids >= e)` false: s <= ids <= e - 1)."""
    node = graph[name]
    if node.op in ("bitwise_not", "logical_not"):
        return _where(graph, node.inputs[0], not truth)
    if (node.op in ("bitwise_and", "logical_and") and truth
            or node.op in ("bitwise_or", "logical_or") and not truth):
        both = [_where(graph, i, truth) for i in node.inputs]
        merged: dict[str, tuple[float, float]] = {}
        for bounds in both:
            for tested, (low, high) in (bounds or {}).items():
                old_low, old_high = merged.get(tested, (-_UNBOUNDED, _UNBOUNDED))
                merged[tested] = (max(low, old_low), min(high, old_high))
        return merged or None
    value = node.attr("value")
    if node.op not in _ORDERINGS or not isinstance(value, int) or isinstance(value, bool) \
            or graph[node.inputs[0]].shape != node.shape:
        return None
    below, above = {"lt_scalar": (value - 1, value), "le_scalar": (value, value + 1),
                    "gt_scalar": (value, value + 1), "ge_scalar": (value - 1, value)}[node.op]
    upper = node.op in ("lt_scalar", "le_scalar")  # true means at most `below`
    return {node.inputs[0]: (-_UNBOUNDED, below) if upper == truth else (above, _UNBOUNDED)}


def _gathered(partners: tuple | None, ranges: list[dict[str, ValueRange]]) -> ValueRange | None:
    if partners is None:
        return None
    members = [ranges[member].get(name) for member, name in partners[0]]
    return None if None in members else _union(members)


def _union(ranges: list[ValueRange]) -> ValueRange:
    result = ranges[0]
    for other in ranges[1:]:
        result = result.union(other)
    return result


def _spanned(values: list[int]) -> ValueRange:
    return ValueRange(min(values), max(values))


def _product(a: ValueRange, b: ValueRange) -> ValueRange:
    return _spanned([a.low * b.low, a.low * b.high, a.high * b.low, a.high * b.high])


def _times(bound: ValueRange, count: int) -> ValueRange:
    """The range of a sum of `count` values in `bound`."""
    return _spanned([bound.low * count, bound.high * count])


def _count(before: tuple[int, ...], after: tuple[int, ...]) -> int:
    """How many values a reduction from `before` to `after` (kept dims) sums into each."""
    count = 1
    for size, kept in zip(before, after):
        count *= size // kept if kept else 1
    return count


def _integral(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def assuming(graphs: list[Graph], assumed: Mapping[str, ValueRange]) -> list[Graph]:
    """The graphs with every comparison the ranges decide (the assumed ones and the ops' own)
    replaced by its constant, and masks, conditions and factors that are then constant dropped
    (the graphs are one program's ranks, or the reference alone)."""
    inputs = {node.attr("target"): node for node in graphs[0].placeholders()
              if node.attr("kind") == "input"}
    for name in assumed:
        if name not in inputs or not _integral(inputs[name].dtype):
            what = f"a {inputs[name].dtype} input" if name in inputs else "not an input"
            raise ScalifyError(f"assume.{name}: a range is assumed of integer inputs; {name} is "
                               f"{what} (inputs: {', '.join(sorted(inputs))})")
    with_assumed = value_ranges(graphs, assumed)
    intrinsic = value_ranges(graphs, {}) if assumed else with_assumed
    return [_decided(graph, known, own) for graph, known, own in zip(graphs, with_assumed, intrinsic)]


def _decided(graph: Graph, known: dict[str, ValueRange], intrinsic: dict[str, ValueRange]) -> Graph:
    values = constant_values(graph)
    result, decided = Graph(outputs=list(graph.outputs)), False
    for node in graph:
        value = node.attr("value")
        test = _EQUALITIES.get(node.op) or _ORDERINGS.get(node.op)
        bound = (known if node.op in _EQUALITIES else intrinsic).get(node.inputs[0]) if test else None
        holds = (test(bound, value) if bound is not None and node.name not in values
                 and isinstance(value, (int, float)) and not isinstance(value, bool) else None)
        if holds is not None:
            node = replace(node, op="full", inputs=(), attrs=(
                ("dtype", node.dtype), ("shape", node.shape), ("value", holds)))
            decided = True
        result.add(node)
    return _simplified(result) if decided else graph


def _simplified(decided: Graph) -> Graph:
    """Users of a node that computes its input unchanged (a fill under an all-false mask, a
    choice under a constant condition, a product with ones) read that input instead."""
    values = constant_values(decided)
    return with_aliases(decided, lambda node, kept: _unchanged_input(node, values, kept))


def _unchanged_input(node: Node, values: dict[str, torch.Tensor | None], graph: Graph) -> str | None:
    """The input `node` returns unchanged, if the constants it reads make it so."""
    def constant(k: int) -> torch.Tensor | None:
        return values.get(node.inputs[k]) if len(node.inputs) > k else None

    if node.op == "masked_fill":
        mask = constant(1)
        candidate = node.inputs[0] if mask is not None and not bool(mask.any()) else None
    elif node.op == "where":
        condition = constant(0)
        candidate = (None if condition is None else node.inputs[1] if bool(condition.all())
                     else node.inputs[2] if not bool(condition.any()) else None)
    elif node.op in ("mul", "logical_and"):
        ones = [k for k in (0, 1) if constant(k) is not None and bool((constant(k) == 1).all())]
        candidate = node.inputs[1 - ones[0]] if ones else None
    else:
        candidate = None
    if candidate is None:
        return None
    kept = graph[candidate]
    return candidate if (kept.shape, kept.dtype) == (node.shape, node.dtype) else None
