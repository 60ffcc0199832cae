"""Ops the capture could not lower (`opaque` nodes): what depends on them, and how to say so.

Nothing is known about an opaque value, so no relation through it is proven or refuted: the
verdict of everything that depends on it is unknown, never verified. So it is for a random draw
of the reference: no draw of the ranks is known to equal it.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node


def opaque_dependents(graph: Graph) -> set[str]:
    """The names of the opaque nodes and of every node that depends on one."""
    found: set[str] = set()
    for node in graph:
        if node.op == "opaque" or found.intersection(node.inputs):
            found.add(node.name)
    return found


def unknown_reason(graph: Graph, node: Node) -> str:
    """The report line for opaque node (or random draw) `node` of the reference `graph`."""
    found = {node.name}
    for other in graph:
        if found.intersection(other.inputs):
            found.add(other.name)
    what = (f"{node.attr('target')} at {node.source}: {node.attr('reason')}" if node.op == "opaque"
            else f"torch.empty at {node.source}: uninitialised memory, read before anything was "
                 "written into it" if node.op == "uninitialized"
            else f"aten.{node.op} at {node.source}: a random draw, which no draw of the ranks "
                 "is known to equal")
    return f"{what}; the {len(found) - 1} op(s) depending on it are unknown"


def opaque_sources(graph: Graph, names: set[str]) -> str:
    """The opaque ops (`target at file:line`) the nodes `names` depend on, for a report line."""
    found, stack, seen = [], sorted(names), set()
    while stack:
        node = graph[stack.pop()]
        if node.name in seen:
            continue
        seen.add(node.name)
        if node.op == "opaque":
            found.append(f"{node.attr('target')} at {node.source}")
        stack.extend(node.inputs)
    return ", ".join(sorted(set(found)))


def opaque_targets(*graphs: Graph) -> list[str]:
    """The ops (`aten.name at file:line`) of `graphs` that are opaque, in order, once each."""
    return list(dict.fromkeys(f"{node.attr('target')} at {node.source}" for graph in graphs
                              for node in graph if node.op == "opaque"))
