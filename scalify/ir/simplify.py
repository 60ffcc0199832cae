"""Identities removed from a graph before it is verified: a transpose of a transpose of the same
two dims is its input (autograd writes `t().t()`, and implementations differ in where they
transpose), so neither program's windows hold the round trip."""
from __future__ import annotations

from dataclasses import replace

from .graph import Graph, Node


def _dims(node: Node) -> frozenset[int]:
    rank = len(node.shape)
    return frozenset((node.attr("dim0") % rank, node.attr("dim1") % rank))


def without_double_transposes(graph: Graph) -> Graph:
    """The graph with every transpose that undoes its input's transpose replaced by that
    transpose's input (its users read it instead; an unused inner transpose stays)."""
    alias: dict[str, str] = {}
    result = Graph()
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        inner = result[node.inputs[0]] if node.op == "transpose" else None
        if inner is not None and inner.op == "transpose" and _dims(inner) == _dims(node):
            alias[node.name] = inner.inputs[0]
            continue
        result.add(node)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result
