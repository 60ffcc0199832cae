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
