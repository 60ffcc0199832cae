"""Identities removed from a graph before it is verified: a transpose of a transpose of the same
two dims is its input (autograd writes `t().t()`, and implementations differ in where they
transpose), so neither program's windows hold the round trip; and a pure op applied again to
the same inputs with the same attributes (the backward of a loss recomputing `out - target`, a
mask built twice) is its first application, so the ops that read either copy meet at one
tensor in the windows that relate them."""
from __future__ import annotations

from dataclasses import replace

from .graph import Graph, Node
from .masks import masks_as_fills
from .ops import COLLECTIVE, OPS, PLACEHOLDER, POINT_TO_POINT, RANDOM

# Applications that are values of their own however they were called: inputs, draws, exchanges
# (matched across ranks in program order) and uninterpreted calls.
_DISTINCT_TRAITS = frozenset({PLACEHOLDER, RANDOM, COLLECTIVE, POINT_TO_POINT})
_DISTINCT_OPS = frozenset({"opaque"})


def simplified(graph: Graph) -> Graph:
    """The graph without transpose round trips and repeated applications, its attention masks
    as fills (`masks.py`)."""
    return without_repeats(masks_as_fills(without_double_transposes(graph)))


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
    alias: dict[str, str] = {}
    first: dict[tuple, str] = {}
    result = Graph()
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        if node.op not in _DISTINCT_OPS and OPS[node.op].trait not in _DISTINCT_TRAITS:
            key = (node.op, node.inputs, node.attrs, node.shape, node.dtype, node.source.module)
            try:
                earlier = first.setdefault(key, node.name)
            except TypeError:  # an attribute with no hash (a tensor): kept as it is
                earlier = node.name
            if earlier != node.name:
                alias[node.name] = earlier
                continue
        result.add(node)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result
