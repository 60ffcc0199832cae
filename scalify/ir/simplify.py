"""Identities removed from a graph before it is verified: a transpose of a transpose of the same
two dims is its input (autograd writes `t().t()`, and implementations differ in where they
transpose), so neither program's windows hold the round trip; and a pure op applied again to
the same inputs with the same attributes (the backward of a loss recomputing `out - target`, a
mask built twice) is its first application, so the ops that read either copy meet at one
tensor in the windows that relate them. A norm raised to its order again (`torch.norm(g) ** 2`,
as gradient clipping sums norms) is the sum it was the root of, and an addition of zero is its
other operand (`without_zero_fills`, `without_zero_shifts`), and so is an addition of a
difference from it (`without_cancelled_differences`); a power of 1 is its base; a slice
that takes one operand of a concat is that operand (`without_concat_picks`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .graph import Graph, Node
from .masks import masks_as_fills
from .ops import COLLECTIVE, OPS, PLACEHOLDER, POINT_TO_POINT, RANDOM
from .scaling import power_of_scalar

# Applications that are values of their own however they were called: inputs, draws, exchanges
# (matched across ranks in program order) and uninterpreted calls.
_DISTINCT_TRAITS = frozenset({PLACEHOLDER, RANDOM, COLLECTIVE, POINT_TO_POINT})
_DISTINCT_OPS = frozenset({"opaque"})


def simplified(graph: Graph, non_negative_sums: frozenset[str] = frozenset()) -> Graph:
    """The graph without transpose round trips, slices that take a concat's operand,
    root-then-power round trips, powers of 1, additions of zero fills and repeated
    applications, its attention masks as fills
    (`masks.py`). `non_negative_sums` names the all-reduces whose inputs are non-negative on
    every rank (`simplified_ranks`)."""
    return without_repeats(masks_as_fills(without_cancelled_differences(without_zero_fills(
        without_unit_powers(without_root_powers(without_concat_picks(
            without_double_transposes(graph)), non_negative_sums))))))


def simplified_ranks(graphs: list[Graph]) -> list[Graph]:
    """Every rank's graph simplified, where an all-reduce (a sum or max) counts as non-negative
    when the value each rank gives it is (the ranks' all-reduces matched in program order per
    group, as the ranks run them): a norm reduced over ranks and then squared is the sum."""
    keys = [_reduction_keys(graph) for graph in graphs]
    everywhere = set.intersection(*({key for name, key in named.items()
                                     if _non_negative(graph, graph[name].inputs[0])}
                                    for graph, named in zip(graphs, keys))) if graphs else set()
    return [simplified(graph, frozenset(name for name, key in named.items() if key in everywhere))
            for graph, named in zip(graphs, keys)]


def _reduction_keys(graph: Graph) -> dict[str, tuple]:
    """Each sum or max all-reduce of `graph` by (group, its place among the group's
    collectives)."""
    return collective_keys(graph, lambda node: node.op == "all_reduce"
                           and node.attr("reduce") in ("sum", "max"))


def collective_keys(graph: Graph, wanted: Callable[[Node], bool]) -> dict[str, tuple]:
    """Each `wanted` collective of `graph` by (group, its place among the group's collectives):
    the ranks' collectives matched in program order, as they run."""
    counts: dict[object, int] = {}
    keys = {}
    for node in graph:
        if OPS[node.op].trait != COLLECTIVE:
            continue
        group = node.attr("group")
        counts[group] = counts.get(group, 0) + 1
        if wanted(node):
            keys[node.name] = (group, counts[group])
    return keys


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


def without_concat_picks(graph: Graph) -> Graph:
    """The graph with every slice that takes exactly one operand of a concat along its dim
    (through nested concats) replaced by that operand, and one that lies within an operand by
    the slice of that operand: a flat buffer a rank writes its own partition into and reads
    back (ZeRO's partitions), whose concats differ by rank in where the written operand sits,
    or into whose zeros gradients are added."""
    def operand(node: Node, kept: Graph) -> str | None:
        if node.op != "slice":
            return None
        dim, start, end = node.attr("dim") % len(node.shape), node.attr("start"), node.attr("end")
        source = kept[node.inputs[0]]
        while source.op == "concat" and source.attr("dim") % len(source.shape) == dim:
            offset = 0
            for part in source.inputs:
                size = kept[part].shape[dim]
                if offset <= start and end <= offset + size:
                    break
                offset += size
            else:
                return None
            start, end = start - offset, end - offset
            if (start, end) == (0, size):
                return part
            source = kept[part]
        if source.name == node.inputs[0]:
            return None
        # within one operand: the slice of that operand (a cut of zeros is zeros)
        moved = replace(node, name=f"{node.name}.in", inputs=(source.name,),
                        attrs=tuple(sorted({**dict(node.attrs), "start": start,
                                            "end": end}.items())))
        kept.add(moved)
        return moved.name

    return with_aliases(graph, operand)


def without_repeats(graph: Graph) -> Graph:
    """The graph with every repeated pure application replaced by its first (its users read
    that one instead), within one module: the windows that relate a layer's ops look only at
    that layer's, so identical layers keep their own copies. The first names the lines that
    computed it again among those that passed its value on (a key's positions computed as
    the query's by mistake are the query's node, and the mistake's line is named with it)."""
    first: dict[tuple, str] = {}
    again: dict[str, list[str]] = {}

    def earlier_application(node: Node, _: Graph) -> str | None:
        if node.op in _DISTINCT_OPS or OPS[node.op].trait in _DISTINCT_TRAITS:
            return None
        key = (node.op, node.inputs, node.attrs, node.shape, node.dtype, node.source.module)
        try:
            earlier = first.setdefault(key, node.name)
        except TypeError:  # an attribute with no hash (a tensor): kept as it is
            return None
        if earlier == node.name:
            return None
        if node.source.file:
            again.setdefault(earlier, []).append(f"{node.source.file}:{node.source.line}")
        return earlier

    return _computed_again(with_aliases(graph, earlier_application), again)


def _computed_again(graph: Graph, again: dict[str, list[str]]) -> Graph:
    """`graph` with each node's `again` lines among its source's `passed_at`."""
    if not again:
        return graph
    result = Graph()
    for node in graph:
        if node.name in again:
            source = node.source
            passed = tuple(dict.fromkeys((*source.passed_at, *again[node.name])))
            node = replace(node, source=replace(source, passed_at=passed))
        result.add(node)
    result.outputs = list(graph.outputs)
    return result


_ZERO_MOVES = frozenset({"expand", "unsqueeze", "squeeze", "slice", "merge", "split",
                         "transpose"})
_LOOKUPS = frozenset({"take", "index", "embedding"})  # their first input is the table


def without_zero_fills(graph: Graph) -> Graph:
    """The graph with every `zeros + x` (and `x - zeros`) where x has the result's shape and
    dtype replaced by x (its users read x instead; zeros no other op reads are dropped): a
    norm accumulated into `torch.zeros(1)`, experts' outputs summed into `zeros_like(x)`, the
    picks from zeros that DTensor's loss backward subtracts. Broadcasts, slices and reshapes of
    zeros and lookups in them are zeros, and so are literals of zeros (a buffer made before the capture began: a
    distributed optimizer's gradient buffer)."""
    zeros: set[str] = set()  # zero fills, and broadcasts of them

    def other_than_zeros(node: Node, kept: Graph) -> str | None:
        if node.op == "full" and node.attr("value") == 0 or (
                node.op == "literal" and not any(node.attr("values"))) or (
                node.op in _ZERO_MOVES | _LOOKUPS and node.inputs[0] in zeros):
            zeros.add(node.name)
        if node.op == "add" and len(node.inputs) == 2:
            a, b = node.inputs
            return _as_is(node, [a] if b in zeros else [b] if a in zeros else [], kept)
        if node.op == "sub" and len(node.inputs) == 2 and node.inputs[1] in zeros:
            return _as_is(node, [node.inputs[0]], kept)
        return None

    return with_aliases(graph, other_than_zeros)


def without_cancelled_differences(graph: Graph) -> Graph:
    """The graph with every `x + (y - x)` replaced by y (on the reals, as the proof takes
    values): torchtitan's row-parallel bias `b + (b / tp - b).detach()` adds b / tp and passes
    b's gradient."""
    def minuend(node: Node, kept: Graph) -> str | None:
        if node.op != "add" or len(node.inputs) != 2:
            return None
        for x, difference in (node.inputs, node.inputs[::-1]):
            sub = kept[difference] if difference in kept else None
            if sub is not None and sub.op == "sub" and sub.inputs[1] == x:
                return _as_is(node, [sub.inputs[0]], kept)
        return None

    return with_aliases(graph, minuend)


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
                                   "transpose", "add", "concat"})


# Scalings that keep a root non-negative (so its power is the power of the factor times its
# base), by whether the factor qualifies.
_SCALINGS = {"mul_scalar": lambda factor: factor >= 0, "div_scalar": lambda factor: factor > 0}
_MOVES_ELEMENTS = frozenset({"concat", "unsqueeze", "squeeze", "merge", "split", "transpose",
                             "expand", "slice"})


def without_root_powers(graph: Graph, non_negative_sums: frozenset[str] = frozenset()) -> Graph:
    """The graph with every `(x ** (1/p)) ** p` of a non-negative x replaced by x: a sum of
    squares raised to 0.5 and squared again is that sum. Roots gathered by data movement and
    scaled by non-negative factors, then raised (PyTorch's norm of the stacked norms, DTensor's
    share of a replicated norm), are their bases moved and scaled alike."""
    return with_aliases(graph, lambda node, kept: _root_power_base(node, kept, non_negative_sums))


def _root_power_base(node: Node, graph: Graph, sums: frozenset[str]) -> str | None:
    """The value `node` equals if it raises roots of its power back, adding to `graph` the
    movement of the roots' bases where the roots were moved."""
    if node.op != "pow_scalar" or not _moved_roots(graph, node.inputs[0], node.attr("value"), sums):
        return None
    return _bases(graph, node.inputs[0], node.attr("value"))


def _moved_roots(graph: Graph, name: str, power: object, sums: frozenset[str]) -> bool:
    """Whether every element of node `name` is a root of order `power` of a non-negative value,
    taken by data movement and scaled by non-negative factors."""
    node = graph[name]
    if node.op == "pow_scalar":
        return _reciprocal(node.attr("value"), power) and _non_negative(graph, node.inputs[0],
                                                                        sums)
    if node.op in _SCALINGS:
        factor = node.attr("value")
        return (isinstance(factor, (int, float)) and _SCALINGS[node.op](factor)
                and _moved_roots(graph, node.inputs[0], power, sums))
    return node.op in _MOVES_ELEMENTS and bool(node.inputs) and all(
        _moved_roots(graph, i, power, sums) for i in node.inputs)


def _bases(graph: Graph, name: str, power: float) -> str:
    """The node holding the roots' bases where `name` holds the roots (new movement and scaling
    nodes are added to `graph`, once each)."""
    node = graph[name]
    if node.op == "pow_scalar":
        return node.inputs[0]
    moved = f"{name}.bases"
    if moved not in graph:
        inputs = tuple(_bases(graph, i, power) for i in node.inputs)
        attrs = ((("value", power_of_scalar(node.attr("value"), power)),) if node.op in _SCALINGS
                 else node.attrs)
        graph.add(replace(node, name=moved, inputs=inputs, attrs=attrs,
                          dtype=graph[inputs[0]].dtype))
    return moved


def _reciprocal(root: object, power: object) -> bool:
    return isinstance(root, (int, float)) and isinstance(power, (int, float)) and power != 0 and (
        abs(root * power - 1) < 1e-12)


def _non_negative(graph: Graph, name: str, sums: frozenset[str] = frozenset()) -> bool:
    """Whether node `name` is non-negative by construction: an even power or an absolute value,
    moved, summed or added (over ranks too: `sums` names such all-reduces)."""
    node = graph[name]
    if node.op == "abs" or node.op == "pow_scalar" and node.attr("value") in (2, 2.0, 4, 4.0):
        return True
    if name in sums:
        return True
    return node.op in _NON_NEGATIVE_KEEPING and bool(node.inputs) and all(
        _non_negative(graph, i, sums) for i in node.inputs)


def with_aliases(graph: Graph, equal_earlier: Callable[[Node, Graph], str | None]) -> Graph:
    """The graph with every node for which `equal_earlier` names an earlier node of the same
    value (an input it returns unchanged, a first application), given the nodes kept so far,
    replaced by that node: its users read that one instead, and what no other op reads any
    more is dropped."""
    alias: dict[str, str] = {}
    result = Graph()
    for node in graph:
        if alias:
            inputs = tuple(alias.get(i, i) for i in node.inputs)
            if inputs != node.inputs:
                node = replace(node, inputs=inputs)
        kept = equal_earlier(node, result)
        if kept is not None:
            alias[node.name] = kept
            continue
        result.add(node)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result.pruned() if alias else result
