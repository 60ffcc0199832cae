"""Rank symmetry: when every rank runs one program up to rank-affine integers, verify it once.

SPMD ranks usually differ only in integers such as the first vocabulary row a rank holds. If
rank r's graph equals rank 0's with each differing integer equal to `scale * r + offset`, the
family of programs is one symbolic program: collectives become whole-family terms (`rsum`,
`rcat`, `rslice`) and the differing integers become `RankAffine` values. Verifying it proves
every rank at once, at a cost that does not grow with the number of ranks. Anything else (a
sub-group collective, uneven shards, a non-affine difference) keeps the per-rank path.
"""
from __future__ import annotations

import reprlib

from dataclasses import dataclass, replace

from .distributed import COLLECTIVES, POINT_TO_POINT, DistributedGraph, qualified
from .graph import Graph, Node

# Integer attributes that may differ by rank, per op.
_RANK_ATTRS = {"add_scalar": ("value",), "lt_scalar": ("value",), "le_scalar": ("value",),
               "gt_scalar": ("value",), "ge_scalar": ("value",), "eq_scalar": ("value",),
               "ne_scalar": ("value",), "slice": ("start", "end"), "pad": ("before", "after")}


@dataclass(frozen=True)
class RankAffine:
    """An integer that is `scale * rank + offset` on each rank."""

    scale: int
    offset: int

    def at(self, rank: int) -> int:
        return self.scale * rank + self.offset

    def __repr__(self) -> str:
        return f"{self.scale}*rank+{self.offset}"


def symbolic_program(graphs: list[Graph]) -> tuple[DistributedGraph | None, str]:
    """The one program that stands for every rank, or None and the reason there is none."""
    world = len(graphs)
    if world < 2:
        return None, "a single rank"
    p2p = next((n for g in graphs for n in g if n.op in POINT_TO_POINT), None)
    if p2p is not None:
        return None, f"{p2p.source}: the ranks exchange point-to-point {p2p.op}s (pipeline stages)"
    first = graphs[0]
    if any(len(g) != len(first) for g in graphs[1:]):
        return None, "the ranks' programs differ in length"
    graphs = [first] + [_named_as(g, first) for g in graphs[1:]]
    if any(g.outputs != first.outputs for g in graphs[1:]):
        return None, "the ranks' programs differ in their outputs"
    nodes = []
    for position, node in enumerate(first.nodes):
        peers = [g.nodes[position] for g in graphs]
        symbolic, why = _unify(node, peers, first)
        if symbolic is None:
            return None, why
        nodes.append(symbolic)
    graph = Graph(outputs=[qualified(0, o) for o in first.outputs])
    for node in _gather_along(nodes, world):
        graph.add(node)
    order = {node.name: (0, i) for i, node in enumerate(graph.nodes)}
    return DistributedGraph(graph, world, [list(graph.outputs)], order, symbolic=True), "used"


def _named_as(graph: Graph, first: Graph) -> Graph:
    """`graph` with each node named as the node at its position in `first` (the tracer numbers
    nodes as it goes, so a rank that emitted and dropped one more node names the rest apart)."""
    names = {node.name: model.name for node, model in zip(graph.nodes, first.nodes)}
    if all(old == new for old, new in names.items()):
        return graph
    renamed = Graph(outputs=[names[o] for o in graph.outputs])
    for node in graph:
        renamed.add(replace(node, name=names[node.name],
                            inputs=tuple(names[i] for i in node.inputs)))
    return renamed


def _unify(node: Node, peers: list[Node], graph: Graph) -> tuple[Node | None, str]:
    world = len(peers)
    for peer in peers[1:]:
        if (peer.op, peer.inputs, peer.shape, peer.dtype, [k for k, _ in peer.attrs]) != \
                (node.op, node.inputs, node.shape, node.dtype, [k for k, _ in node.attrs]):
            return None, f"{node.source}: the ranks run different {node.op} ops here"
    attrs = []
    for index, (key, value) in enumerate(node.attrs):
        if key == "layout":  # how each rank holds a DTensor input: read into its placement
            continue
        values = [peer.attrs[index][1] for peer in peers]
        if all(v == value for v in values):
            attrs.append((key, value))
            continue
        affine = _affine(values) if key in _RANK_ATTRS.get(node.op, ()) else None
        if affine is None:
            shown = ", ".join(reprlib.repr(v) for v in values[:4])
            return None, (f"{node.source}: {node.op} attribute {key} differs across ranks "
                          f"({shown}, ...) and is not affine in the rank")
        attrs.append((key, affine))
    if node.op == "all_to_all":
        return None, f"{node.source}: all_to_all is verified rank by rank"
    if node.op in COLLECTIVES:
        group = tuple(dict(attrs).get("group") or range(world))
        if group != tuple(range(world)):
            return None, f"{node.source}: {node.op} on the sub-group {list(group)}"
        attrs = [(k, v) for k, v in attrs if k != "group"] + [("family", world)]
    if node.op == "slice" and not _rank_block(dict(attrs), graph[node.inputs[0]].shape, world):
        return None, f"{node.source}: a rank-dependent slice that is not the rank's own block"
    if node.op == "pad" and not _rank_block_in_zeros(dict(attrs), world):
        return None, f"{node.source}: a rank-dependent pad that does not put the rank's block in zeros"
    return replace(node, name=qualified(0, node.name),
                   inputs=tuple(qualified(0, i) for i in node.inputs), attrs=tuple(attrs)), ""


def _affine(values: list) -> RankAffine | None:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    affine = RankAffine(values[1] - values[0], values[0])
    return affine if all(affine.at(r) == v for r, v in enumerate(values)) else None


def _rank_block(attrs: dict, shape: tuple[int, ...], world: int) -> bool:
    """A slice whose bounds are constant, or exactly block `rank` of `world` equal blocks that
    tile the dim (of size `shape[dim]`)."""
    start, end = attrs["start"], attrs["end"]
    if not isinstance(start, RankAffine) and not isinstance(end, RankAffine):
        return True
    return (isinstance(start, RankAffine) and isinstance(end, RankAffine) and start.offset == 0
            and start.scale == end.scale == end.offset
            and start.scale * world == shape[attrs["dim"]])


def _rank_block_in_zeros(attrs: dict, world: int) -> bool:
    """A pad whose widths are constant, or that puts a block at block `rank` of `world` equal
    blocks of zeros (the backward of the rank's own block)."""
    before, after = attrs["before"], attrs["after"]
    if not isinstance(before, RankAffine) and not isinstance(after, RankAffine):
        return True
    return (isinstance(before, RankAffine) and isinstance(after, RankAffine) and attrs["value"] == 0
            and before.offset == 0 and after.scale == -before.scale
            and after.offset == before.scale * (world - 1))


def _users_of(nodes: list[Node]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for node in nodes:
        for name in node.inputs:
            users.setdefault(name, []).append(node.name)
    return users


def _concat_leaves(top: Node, by_name: dict[str, Node], users: dict[str, list[str]],
                   inner: list[str]) -> list[str]:
    """A concat chain's leaves, descending into concats along the same dim used only by the
    chain (collected in `inner`)."""
    leaves = []
    for name in top.inputs:
        node = by_name[name]
        if node.op == "concat" and node.attr("dim") == top.attr("dim") and \
                users.get(name) == [top.name]:
            inner.append(name)
            leaves += _concat_leaves(node, by_name, users, inner)
        else:
            leaves.append(name)
    return leaves


def _gather_along(nodes: list[Node], world: int) -> list[Node]:
    """Fold `all_gather` (dim 0) + one slice per rank block + concats along dim e into one family
    gather along e (how functional collectives gather along other dims)."""
    by_name = {node.name: node for node in nodes}
    users = _users_of(nodes)
    folded: dict[str, Node] = {}
    dropped: set[str] = set()
    for node in nodes:
        if node.op != "all_gather":
            continue
        rows = node.shape[0] // world
        blocks = [by_name[name] for name in users.get(node.name, [])]
        if len(blocks) != world or any(
                b.op != "slice" or dict(b.attrs) != {"dim": 0, "start": k * rows, "end": (k + 1) * rows}
                or len(users.get(b.name, [])) != 1 for k, b in enumerate(blocks)):
            continue
        top = by_name[users[blocks[0].name][0]]
        while top.op == "concat" and len(users.get(top.name, [])) == 1 and \
                by_name[users[top.name][0]].op == "concat" and \
                by_name[users[top.name][0]].attr("dim") == top.attr("dim"):
            top = by_name[users[top.name][0]]
        inner: list[str] = []
        if top.op != "concat" or _concat_leaves(top, by_name, users, inner) != [b.name for b in blocks]:
            continue
        folded[top.name] = replace(top, op="all_gather", inputs=node.inputs,
                                   attrs=(("dim", top.attr("dim")), ("family", world)),
                                   source=node.source)
        dropped.update([node.name, *(b.name for b in blocks), *inner])
    return [folded.get(node.name, node) for node in nodes if node.name not in dropped]

