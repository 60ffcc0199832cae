"""Broadcasts resolved across ranks: one member's block of an all_gather (what `dist.broadcast`
lowers to, and a gather into a list read at a fixed member) is that member's value. Where the
member computes it from inputs that are the same on every rank (a data loader's batch read on
one rank and broadcast, as Megatron's `broadcast_data` does), every rank's program gets the
member's computation in place of the block: the value is the same by construction (the copy
reads equal inputs with the member's own constants), and the ranks, which ran different code
before the broadcast, now run one program, so rank symmetry applies. A member's value that
reads a sharded input, a collective, a point-to-point exchange, a random draw or an opaque call
stays a block of the gather.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .graph import Graph, Node
from .ops import COLLECTIVE, OPAQUE, OPS, PLACEHOLDER, POINT_TO_POINT, RANDOM
from .simplify import collective_keys, with_aliases

_NOT_PORTABLE = frozenset({COLLECTIVE, POINT_TO_POINT, RANDOM, OPAQUE})


def with_broadcasts_resolved(graphs: list[Graph], replicated: Callable[[str], bool]
                             ) -> list[Graph]:
    """Every rank's graph with each block of an all_gather that is one member's value replaced
    by that value where every input its computation reads is `replicated` (by placeholder
    target): its own node on the member, a copy of the member's computation elsewhere."""
    keys = [collective_keys(graph, lambda node: node.op == "all_gather") for graph in graphs]
    by_key = [{key: name for name, key in named.items()} for named in keys]
    resolved = []
    for rank, graph in enumerate(graphs):
        def member_value(node: Node, kept: Graph) -> str | None:
            found = _member_block(kept, node, len(graphs))
            if found is None:
                return None
            gather, member = found
            source = by_key[member].get(keys[rank][gather.name])
            if source is None or graphs[member][source].shape != gather.shape:
                return None
            return _copied(graphs[member], graphs[member][source].inputs[0], kept,
                           None if member == rank else f"r{member}_", replicated)
        resolved.append(with_aliases(graph, member_value))
    return resolved


def _member_block(graph: Graph, node: Node, world: int) -> tuple[Node, int] | None:
    """(the all_gather, the global rank of the member) when `node` (reading `graph`) slices
    exactly one member's block out of an all_gather, else None."""
    if node.op != "slice" or node.attr("dim") != 0:
        return None
    gather = graph[node.inputs[0]]
    if gather.op != "all_gather":
        return None
    rows = graph[gather.inputs[0]].shape[0]
    start, end = node.attr("start"), node.attr("end")
    if not rows or start % rows or end - start != rows:
        return None
    group = tuple(gather.attr("group") or range(world))
    return gather, group[start // rows]


def _copied(source: Graph, value: str, kept: Graph, prefix: str | None,
            replicated: Callable[[str], bool]) -> str | None:
    """The name in `kept` of `source`'s computation of `value`: the value itself without a
    `prefix` (`source` is the graph `kept` is built from), else a copy added to `kept` with its
    nodes' names prefixed (reading `kept`'s own placeholders); None when that computation is
    not portable."""
    needed, stack = {}, [value]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        node = needed[name] = source[name]
        trait = OPS[node.op].trait
        if trait in _NOT_PORTABLE:
            return None
        if trait == PLACEHOLDER:
            if not replicated(name) or node.attr("layout") is not None or name not in kept \
                    or kept[name].shape != node.shape:
                return None
            continue
        stack.extend(node.inputs)
    if prefix is None:  # the member's own block
        return value if value in kept else None
    renamed = {name: name if OPS[node.op].trait == PLACEHOLDER else prefix + name
               for name, node in needed.items()}
    for node in source:
        if node.name in needed and OPS[node.op].trait != PLACEHOLDER \
                and renamed[node.name] not in kept:
            kept.add(replace(node, name=renamed[node.name],
                             inputs=tuple(renamed[i] for i in node.inputs)))
    return renamed[value]
