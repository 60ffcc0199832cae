"""Merges per-rank graphs into one distributed graph whose collectives read every member's input."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from ..errors import ScalifyError
from .graph import Graph, Node

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_SHAPES_MAY_DIFFER = ("all_to_all",)  # each rank receives its own blocks


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
    partners = _match_collectives(graphs)
    nodes: dict[str, Node] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            name = qualified(rank, node.name)
            if name in partners:
                members, index, extra = partners[name]
                node = replace(node, inputs=tuple(qualified(m, i) for m, i in members),
                               attrs=node.attrs + (("index", index),) + extra)
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


def _match_collectives(graphs: list[Graph]) -> dict[str, tuple[list[tuple[int, str]], int, tuple]]:
    """Each collective's members (rank, input) in group order, its position in the group, and
    the attributes it needs from its members (an all_to_all: every member's `in_splits`)."""
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
            members, splits = [], []
            for member in group:
                others = sequences.get((member, group), [])
                if k >= len(others) or others[k].op != node.op or (
                        others[k].shape != node.shape and node.op not in _SHAPES_MAY_DIFFER):
                    raise ScalifyError(
                        f"{node.source}: collective {node.op} #{k} on group {list(group)} of rank "
                        f"{rank} has no matching call on rank {member} (ranks would hang)")
                members.append((member, others[k].inputs[0]))
                splits.append(others[k].attr("in_splits"))
            extra = (("member_splits", tuple(splits)),) if node.op == "all_to_all" else ()
            partners[qualified(rank, node.name)] = (members, group.index(rank), extra)
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
