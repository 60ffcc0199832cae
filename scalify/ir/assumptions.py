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
from typing import Mapping

import torch

from ..errors import ScalifyError
from .distributed import constant_values, match_collectives, qualified
from .graph import Graph, Node
from .simplify import with_aliases

# Ops whose output takes only values of their first input (data movement).
_MOVES_VALUES = frozenset({"merge", "split", "unsqueeze", "squeeze", "transpose", "expand",
                           "slice", "cast"})
# The comparisons a range decides: equality with a value outside it (an ignore index, a padding
# id). Orderings stay: they are how shards mask ids, and the proof relates them as written.
_DECIDED = frozenset({"eq_scalar", "ne_scalar"})


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
    """Each graph's nodes whose values the assumptions bound (the graphs are one program's
    ranks, so an all_gather's range is the union of its members')."""
    ranges: list[dict[str, ValueRange]] = [{} for _ in graphs]
    partners = match_collectives(graphs) if len(graphs) > 1 else {}
    changed = True
    while changed:  # a gathered range is known once every member's input is
        changed = False
        for rank, graph in enumerate(graphs):
            known = ranges[rank]
            for node in graph:
                if node.name in known:
                    continue
                found = _range(node, known, assumed, partners.get(qualified(rank, node.name)), ranges)
                if found is not None:
                    known[node.name] = found
                    changed = True
    return ranges


def _range(node: Node, known: dict[str, ValueRange], assumed: Mapping[str, ValueRange],
           partners: tuple | None, ranges: list[dict[str, ValueRange]]) -> ValueRange | None:
    if node.op == "placeholder":
        return assumed.get(node.attr("target")) if node.attr("kind") == "input" else None
    if node.op in _MOVES_VALUES or node.op == "concat":
        inputs = [known.get(i) for i in node.inputs]
        if not inputs or None in inputs or (node.op == "cast" and not _integral(node.dtype)):
            return None
        result = inputs[0]
        for other in inputs[1:]:
            result = result.union(other)
        return result
    shift = node.attr("value")
    if node.op == "add_scalar" and node.inputs[0] in known and isinstance(shift, int):
        bound = known[node.inputs[0]]
        return ValueRange(bound.low + shift, bound.high + shift)
    if node.op == "all_gather" and partners is not None:
        members = [ranges[member].get(name) for member, name in partners[0]]
        if None in members:
            return None
        result = members[0]
        for other in members[1:]:
            result = result.union(other)
        return result
    return None


def _integral(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def assuming(graphs: list[Graph], assumed: Mapping[str, ValueRange]) -> list[Graph]:
    """The graphs with every comparison the assumed ranges decide replaced by its constant, and
    masks, conditions and factors that are then constant dropped (the graphs are one program's
    ranks, or the reference alone)."""
    if not assumed:
        return graphs
    inputs = {node.attr("target"): node for node in graphs[0].placeholders()
              if node.attr("kind") == "input"}
    for name in assumed:
        if name not in inputs or not _integral(inputs[name].dtype):
            what = f"a {inputs[name].dtype} input" if name in inputs else "not an input"
            raise ScalifyError(f"assume.{name}: a range is assumed of integer inputs; {name} is "
                               f"{what} (inputs: {', '.join(sorted(inputs))})")
    return [_simplified(_decided(graph, known))
            for graph, known in zip(graphs, value_ranges(graphs, assumed))]


def _decided(graph: Graph, known: dict[str, ValueRange]) -> Graph:
    result = Graph(outputs=list(graph.outputs))
    for node in graph:
        bound = known.get(node.inputs[0]) if node.op in _DECIDED else None
        value = node.attr("value")
        if (bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
                and not bound.low <= value <= bound.high):
            node = replace(node, op="full", inputs=(), attrs=(
                ("dtype", node.dtype), ("shape", node.shape), ("value", node.op == "ne_scalar")))
        result.add(node)
    return result


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
