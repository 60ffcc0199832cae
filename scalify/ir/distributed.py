"""Merges per-rank graphs into one distributed graph whose collectives read every member's input."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from ..errors import ScalifyError
from .graph import Graph, Node

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class DistributedGraph:
    """All ranks in one graph; node names are `r{rank}/{local name}`."""

    graph: Graph
    world_size: int
    rank_outputs: list[list[str]]
    order: dict[str, tuple[int, int]]  # (rank, position in that rank's program): a canonical order
    symbolic: bool = False  # one program stands for every rank (see ir/symmetry.py)

    def rank_of(self, name: str) -> int:
        return int(name[1:name.index("/")])


def qualified(rank: int, name: str) -> str:
    return f"r{rank}/{name}"


def merge_ranks(graphs: list[Graph]) -> DistributedGraph:
    """Match each rank's k-th collective on a group with the other members' k-th, and merge."""
    world = len(graphs)
    graphs = [_folded(graph, world) for graph in graphs]
    partners = _match_collectives(graphs)
    nodes: dict[str, Node] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            name = qualified(rank, node.name)
            if name in partners:
                members, index = partners[name]
                node = replace(node, inputs=tuple(qualified(m, i) for m, i in members),
                               attrs=node.attrs + (("index", index),))
            else:
                node = replace(node, inputs=tuple(qualified(rank, i) for i in node.inputs))
            nodes[name] = replace(node, name=name)
    merged = Graph(outputs=[qualified(r, o) for r, g in enumerate(graphs) for o in g.outputs])
    for node in _topological(graphs, nodes):
        merged.add(node)
    order = {qualified(r, node.name): (r, i) for r, g in enumerate(graphs)
             for i, node in enumerate(g.nodes)}
    return DistributedGraph(merged, len(graphs),
                            [[qualified(r, o) for o in g.outputs] for r, g in enumerate(graphs)],
                            order)


def users_of(nodes: list[Node]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for node in nodes:
        for name in node.inputs:
            users.setdefault(name, []).append(node.name)
    return users


def concat_leaves(top: Node, by_name: dict[str, Node], users: dict[str, list[str]],
                   inner: list[str]) -> list[str]:
    """A concat chain's leaves, descending into concats along the same dim used only by the
    chain (collected in `inner`)."""
    leaves = []
    for name in top.inputs:
        node = by_name[name]
        if node.op == "concat" and node.attr("dim") == top.attr("dim") and \
                users.get(name) == [top.name]:
            inner.append(name)
            leaves += concat_leaves(node, by_name, users, inner)
        else:
            leaves.append(name)
    return leaves


def fold_reduce_scatters(nodes: list[Node], world: int) -> list[Node]:
    """Fold one slice per rank block along dim e + a concat along dim 0 + `reduce_scatter`
    (dim 0) into one family reduce-scatter along e (functional collectives scatter other dims
    that way)."""
    by_name = {node.name: node for node in nodes}
    users = users_of(nodes)
    folded: dict[str, Node] = {}
    dropped: set[str] = set()
    for node in nodes:
        top = by_name.get(node.inputs[0]) if node.op == "reduce_scatter" and node.inputs else None
        if top is None or top.op != "concat" or top.attr("dim") != 0 or \
                users.get(top.name) != [node.name]:
            continue
        inner: list[str] = []
        blocks = [by_name[name] for name in concat_leaves(top, by_name, users, inner)]
        if len(blocks) != world or any(b.op != "slice" or users.get(b.name) != [top.name]
                                       for b in blocks):
            continue
        source, dim = blocks[0].inputs, blocks[0].attr("dim")
        rows = by_name[source[0]].shape[dim] // world if source[0] in by_name else 0
        if rows == 0 or any(b.inputs != source or dict(b.attrs) != {
                "dim": dim, "start": k * rows, "end": (k + 1) * rows} for k, b in enumerate(blocks)):
            continue
        folded[node.name] = replace(node, inputs=source, attrs=node.attrs + (("dim", dim),))
        dropped.update([top.name, *inner, *(b.name for b in blocks)])
    return [folded.get(node.name, node) for node in nodes if node.name not in dropped]


def _folded(graph: Graph, world: int) -> Graph:
    """`graph` with functional collectives' reduce-scatters along other dims folded."""
    folded = Graph(outputs=list(graph.outputs))
    for node in fold_reduce_scatters(graph.nodes, world):
        folded.add(node)
    return folded


def _match_collectives(graphs: list[Graph]) -> dict[str, tuple[list[tuple[int, str]], int]]:
    sequences: dict[tuple[int, tuple[int, ...]], list[Node]] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            if node.op in COLLECTIVES:
                group = tuple(node.attr("group")) or tuple(range(len(graphs)))
                if rank not in group:
                    raise ScalifyError(f"{node.source}: rank {rank} runs {node.op} on group {group} "
                                       "that does not contain it")
                sequences.setdefault((rank, group), []).append(node)
    partners = {}
    for (rank, group), calls in sequences.items():
        for k, node in enumerate(calls):
            members = []
            for member in group:
                others = sequences.get((member, group), [])
                if k >= len(others) or others[k].op != node.op or others[k].shape != node.shape:
                    raise ScalifyError(
                        f"{node.source}: collective {node.op} #{k} on group {list(group)} of rank "
                        f"{rank} has no matching call on rank {member} (ranks would hang)")
                members.append((member, others[k].inputs[0]))
            partners[qualified(rank, node.name)] = (members, group.index(rank))
    return partners


def _topological(graphs: list[Graph], nodes: dict[str, Node]) -> list[Node]:
    """Interleave the ranks so that every collective follows all of its members' inputs."""
    positions = [0] * len(graphs)
    done: set[str] = set()
    ordered: list[Node] = []
    while len(ordered) < len(nodes):
        progressed = False
        for rank, graph in enumerate(graphs):
            while positions[rank] < len(graph.nodes):
                node = nodes[qualified(rank, graph.nodes[positions[rank]].name)]
                if not all(i in done for i in node.inputs):
                    break
                ordered.append(node)
                done.add(node.name)
                positions[rank] += 1
                progressed = True
        if not progressed:
            raise ScalifyError("the ranks' collectives cannot be ordered consistently (deadlock)")
    return ordered


def constant_keys(graph: Graph) -> dict[str, str]:
    """A structural hash for every node that depends on no placeholder (same value on every rank)."""
    keys: dict[str, str] = {}
    for node in graph:
        if node.op == "placeholder" or node.op in COLLECTIVES:
            continue
        if all(i in keys for i in node.inputs):
            text = repr((node.op, node.attrs, node.shape, node.dtype, [keys[i] for i in node.inputs]))
            keys[node.name] = hashlib.sha1(text.encode()).hexdigest()[:16]
    return keys


def constant_terms(graph: Graph) -> dict[str, str]:
    """The egglog term of every node that depends on no placeholder: a `(const "hash")` leaf,
    except that broadcasts of constants stay `expand`/`unsqueeze` terms, so a constant the size
    of the whole batch relates to each rank's smaller one."""
    keys = constant_keys(graph)
    terms: dict[str, str] = {}
    for node in graph:
        if node.name not in keys:
            continue
        inner = terms.get(node.inputs[0]) if node.inputs else None
        if node.op == "expand" and inner:
            terms[node.name] = f"(expand {inner} {node.attr('dim')} {node.attr('size')})"
        elif node.op == "unsqueeze" and inner:
            terms[node.name] = f"(unsqueeze {inner} {node.attr('dim')})"
        else:
            terms[node.name] = f'(const "{keys[node.name]}")'
    return terms
