"""Identities removed from a graph before it is verified: a transpose of a transpose of the same
two dims is its input (autograd writes `t().t()`, and implementations differ in where they
transpose), so neither program's windows hold the round trip; and a pure op applied again to
the same inputs with the same attributes (the backward of a loss recomputing `out - target`, a
mask built twice) is its first application, so the ops that read either copy meet at one
tensor in the windows that relate them. A norm raised to its order again (`torch.norm(g) ** 2`,
as gradient clipping sums norms) is the sum it was the root of, and an addition of zero is its
other operand (`without_zero_fills`, `without_zero_shifts`); a power of 1 is its base."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .graph import Graph, Node
from .masks import masks_as_fills
from .ops import COLLECTIVE, OPS, PLACEHOLDER, POINT_TO_POINT, RANDOM

# Applications that are values of their own however they were called: inputs, draws, exchanges
# (matched across ranks in program order) and uninterpreted calls.
_DISTINCT_TRAITS = frozenset({PLACEHOLDER, RANDOM, COLLECTIVE, POINT_TO_POINT})
_DISTINCT_OPS = frozenset({"opaque"})


def simplified(graph: Graph) -> Graph:
    """The graph without transpose round trips, root-then-power round trips, powers of 1,
    additions of zero fills and repeated applications, its attention masks as fills
    (`masks.py`)."""
    return without_repeats(masks_as_fills(without_zero_fills(without_unit_powers(
        without_root_powers(without_double_transposes(graph))))))


def _dims(node: Node) -> frozenset[int]:
    rank = len(node.shape)
    return frozenset((node.attr("dim0") % rank, node.attr("dim1") % rank))


def without_double_transposes(graph: Graph) -> Graph:
    """The graph with every transpose that undoes its input's transpose replaced by that
    transpose's input (its users read it instead), and inner transposes left unused dropped."""
    alias: dict[str, str] = {}
    undone: set[str] = set()  # the inner transposes of removed round trips
    kept: list[Node] = []
    nodes: dict[str, Node] = {}
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        inner = nodes.get(node.inputs[0]) if node.op == "transpose" else None
        if inner is not None and inner.op == "transpose" and _dims(inner) == _dims(node):
            alias[node.name] = inner.inputs[0]
            undone.add(inner.name)
            continue
        nodes[node.name] = node
        kept.append(node)
    outputs = [alias.get(o, o) for o in graph.outputs]
    used = set(outputs).union(*(n.inputs for n in kept))
    result = Graph(outputs=outputs)
    for node in kept:
        if node.name in used or node.name not in undone:
            result.add(node)
    return result


def without_repeats(graph: Graph) -> Graph:
    """The graph with every repeated pure application replaced by its first (its users read
    that one instead), within one module: the windows that relate a layer's ops look only at
    that layer's, so identical layers keep their own copies."""
    first: dict[tuple, str] = {}

    def earlier_application(node: Node, _: Graph) -> str | None:
        if node.op in _DISTINCT_OPS or OPS[node.op].trait in _DISTINCT_TRAITS:
            return None
        key = (node.op, node.inputs, node.attrs, node.shape, node.dtype, node.source.module)
        try:
            earlier = first.setdefault(key, node.name)
        except TypeError:  # an attribute with no hash (a tensor): kept as it is
            return None
        return earlier if earlier != node.name else None

    return with_aliases(graph, earlier_application)


_ZERO_BROADCASTS = frozenset({"expand", "unsqueeze", "squeeze"})
_LOOKUPS = frozenset({"take", "index", "embedding"})  # their first input is the table


def without_zero_fills(graph: Graph) -> Graph:
    """The graph with every `zeros + x` (and `x - zeros`) where x has the result's shape and
    dtype replaced by x (its users read x instead; zeros no other op reads are dropped): a
    norm accumulated into `torch.zeros(1)`, experts' outputs summed into `zeros_like(x)`, the
    picks from zeros that DTensor's loss backward subtracts. Broadcasts of zeros and lookups
    in them are zeros."""
    zeros: set[str] = set()  # zero fills, and broadcasts of them

    def other_than_zeros(node: Node, kept: Graph) -> str | None:
        if node.op == "full" and node.attr("value") == 0 or (
                node.op in _ZERO_BROADCASTS | _LOOKUPS and node.inputs[0] in zeros):
            zeros.add(node.name)
        if node.op == "add" and len(node.inputs) == 2:
            a, b = node.inputs
            return _as_is(node, [a] if b in zeros else [b] if a in zeros else [], kept)
        if node.op == "sub" and len(node.inputs) == 2 and node.inputs[1] in zeros:
            return _as_is(node, [node.inputs[0]], kept)
        return None

    return with_aliases(graph, other_than_zeros)


def without_unit_powers(graph: Graph) -> Graph:
    """The graph with every `x ** 1` replaced by x (the backward of `x ** 2` is `2 * x ** 1`;
    of a loss the other program wrote as `mse_loss`, `2 * x`)."""
    return with_aliases(graph, lambda node, kept: _as_is(node, [node.inputs[0]], kept) if (
        node.op == "pow_scalar" and node.attr("value") == 1) else None)


def without_zero_shifts(graph: Graph) -> Graph:
    """The graph with every `x + 0` of floats (Python's `sum()` starts so) replaced by x.
    Applied to a rank's program only where ranks are not matched into one symbolic program
    (a rank's offset of 0 is the family's offset there); integer ids shifted by 0 keep the
    shift the range rules read."""
    return with_aliases(graph, lambda node, kept: _as_is(node, [node.inputs[0]], kept) if (
        node.op == "add_scalar" and node.attr("value") == 0
        and node.dtype.startswith(("float", "bfloat"))) else None)


def _as_is(node: Node, candidates: list[str], graph: Graph) -> str | None:
    """The candidate operand with `node`'s shape and dtype: the value `node` leaves as is."""
    return next((name for name in candidates if graph[name].shape == node.shape
                 and graph[name].dtype == node.dtype), None)


_NON_NEGATIVE_KEEPING = frozenset({"sum", "squeeze", "unsqueeze", "expand", "merge", "split",
                                   "transpose", "add"})


def without_root_powers(graph: Graph) -> Graph:
    """The graph with every `(x ** (1/p)) ** p` of a non-negative x replaced by x: a sum of
    squares raised to 0.5 and squared again is that sum."""
    return with_aliases(graph, _root_power_base)


def _root_power_base(node: Node, graph: Graph) -> str | None:
    inner = graph[node.inputs[0]] if node.op == "pow_scalar" else None
    if (inner is not None and inner.op == "pow_scalar"
            and _reciprocal(inner.attr("value"), node.attr("value"))
            and _non_negative(graph, inner.inputs[0]) and graph[inner.inputs[0]].shape == node.shape):
        return inner.inputs[0]
    return None


def _reciprocal(root: object, power: object) -> bool:
    return isinstance(root, (int, float)) and isinstance(power, (int, float)) and power != 0 and (
        abs(root * power - 1) < 1e-12)


def _non_negative(graph: Graph, name: str) -> bool:
    """Whether node `name` is non-negative by construction: an even power or an absolute value,
    moved, summed or added."""
    node = graph[name]
    if node.op == "abs" or node.op == "pow_scalar" and node.attr("value") in (2, 2.0, 4, 4.0):
        return True
    return node.op in _NON_NEGATIVE_KEEPING and bool(node.inputs) and all(
        _non_negative(graph, i) for i in node.inputs)


def with_aliases(graph: Graph, equal_earlier: Callable[[Node, Graph], str | None]) -> Graph:
    """The graph with every node for which `equal_earlier` names an earlier node of the same
    value (an input it returns unchanged, a first application), given the nodes kept so far,
    replaced by that node: its users read that one instead, and what no other op reads any
    more is dropped."""
    alias: dict[str, str] = {}
    result = Graph()
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        kept = equal_earlier(node, result)
        if kept is not None:
            alias[node.name] = kept
            continue
        result.add(node)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result.pruned() if alias else result
