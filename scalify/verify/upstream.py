"""Where a rank value's scale and layout were decided, for a discrepancy to name beyond the ops
where the ranks and the reference part ways.

The saturation relates every value up to the op that fails, so the lines that decided what the
failing op reads (a gradient divided by the world size twice, a weight cut along the wrong dim)
may lie upstream of the last values it related. Two walks find them in a rank graph: the chain
that carries a value unchanged but for its layout, a collective or a scalar factor, and the cuts
(slices and collectives over parameters and inputs) that the value depends on.
"""
from __future__ import annotations

from collections import deque
from ..ir.distributed import COLLECTIVES
from ..ir.graph import Graph, Node, SourceLoc
from ..ir.ops import MOVEMENT, OPS
from ..rules.families import LINEAR_UNARY_OPS

_CUTS = ("slice", *COLLECTIVES)


def _carries(node: Node) -> bool:
    """Whether the op passes one tensor's values on, moved, reduced over ranks or scaled."""
    return node.op in COLLECTIVES or node.op in LINEAR_UNARY_OPS or (
        node.op in OPS and OPS[node.op].trait == MOVEMENT and len(node.inputs) == 1)


def chain_lines(graph: Graph, start: str, limit: int = 4) -> list[SourceLoc]:
    """The lines of the ops that carry `start`'s value, back to the op that computed it (the
    ops themselves when they move, reduce over ranks or scale one tensor), nearest first."""
    lines: list[SourceLoc] = []
    name = start
    while name in graph and len(lines) < limit:
        node = graph[name]
        if node.source.file and node.source not in lines:
            lines.append(node.source)
        if not _carries(node):
            break
        name = node.inputs[0]
    return lines


def cut_lines(graph: Graph, start: str, limit: int = 2) -> list[SourceLoc]:
    """The lines where the rank cut (sliced or gathered) the parameters and inputs that
    `start` depends on, through data movement only, nearest first."""
    views: dict[str, bool] = {}

    def only_moves_placeholders(name: str) -> bool:
        if name not in views:
            node = graph[name]
            moves = node.op in _CUTS or node.op in OPS and OPS[node.op].trait == MOVEMENT
            views[name] = node.op == "placeholder" or moves and all(
                only_moves_placeholders(i) for i in node.inputs)
        return views[name]

    lines: list[SourceLoc] = []
    seen, queue = {start}, deque([start])
    while queue and len(lines) < limit:
        node = graph[queue.popleft()]
        if node.op in _CUTS and only_moves_placeholders(node.name):
            if node.source.file and node.source not in lines:
                lines.append(node.source)
        for name in node.inputs:
            if name not in seen and name in graph:
                seen.add(name)
                queue.append(name)
    return lines
