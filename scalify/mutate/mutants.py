"""Mutants of a program's rank graphs: apply a change on every rank, keep it only if every node
still type-checks, and sample a campaign's mutants (and the ranks they change) deterministically."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ..ir.distributed import COLLECTIVES, POINT_TO_POINT
from ..ir.graph import Graph, Node, SourceLoc
from ..ir.ops import infer_shape
from .operators import OPERATORS, Change


@dataclass(frozen=True)
class Mutant:
    """The rank graphs with one planted change."""

    operator: str
    node: str
    what: str
    source: SourceLoc
    ranks: list[Graph]


def type_checks(graph: Graph) -> bool:
    """Whether every node's shape is the one its op's shape rule gives for its inputs."""
    for node in graph:
        if node.op == "placeholder" or node.op in POINT_TO_POINT:
            continue
        shapes = [graph[name].shape for name in node.inputs]
        if node.op in COLLECTIVES:
            if not _collective_fits(node, shapes[0], len(node.attr("group") or ())):
                return False
            continue
        try:
            if infer_shape(node.op, shapes, dict(node.attrs)) != node.shape:
                return False
        except (ValueError, IndexError, KeyError, TypeError):
            return False
    return True


def _collective_fits(node: Node, shape: tuple[int, ...], size: int) -> bool:
    if node.op == "all_gather" and size:
        return node.shape == (shape[0] * size,) + shape[1:]
    return node.op != "all_reduce" or node.shape == shape


def apply_change(ranks: list[Graph], change: Change) -> list[Graph] | None:
    """The rank graphs with `change` applied on every rank, or None if a rank does not
    type-check afterwards (or has no such node)."""
    mutated = []
    for rank, graph in enumerate(ranks):
        if change.node not in graph:
            return None
        result = _rewritten(graph, rank, change)
        if result is None or not type_checks(result):
            return None
        mutated.append(result)
    return mutated


def _rewritten(graph: Graph, rank: int, change: Change) -> Graph | None:
    alias: dict[str, str] = {}
    nodes: list[Node] = []
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        if node.name != change.node:
            nodes.append(node)
            continue
        rewrite = change.rewrite(rank, node)
        if isinstance(rewrite, str):
            if graph[rewrite].shape != node.shape:
                return None
            alias[node.name] = rewrite
        else:
            nodes.extend(rewrite)
    result = Graph(outputs=[alias.get(o, o) for o in graph.outputs])
    try:
        for node in nodes:
            result.add(node)
    except ValueError:
        return None
    return result


def mutants(ranks: list[Graph], operator: str, budget: int, seed: int) -> list[Mutant]:
    """At most `budget` type-checking mutants of `operator`, chosen by a seeded draw over
    every site on rank 0's program; each draw also picks the ranks it mutates."""
    world = len(ranks)
    valid = []
    for node in ranks[0]:
        for change in OPERATORS[operator](node, world):
            graphs = apply_change(ranks, change)
            if graphs is not None:
                valid.append(Mutant(operator, change.node, change.what, node.source, graphs))
    draw = random.Random(f"{seed}/{operator}")
    chosen = sorted(draw.sample(range(len(valid)), min(budget, len(valid))))
    return [_scoped(valid[i], ranks, draw) for i in chosen]


def _scoped(mutant: Mutant, ranks: list[Graph], draw: random.Random) -> Mutant:
    """The mutant on every rank, or (for half the draws) on one rank only; a collective is
    always changed on every rank, since a lone rank's change would leave its peers unmatched."""
    if ranks[0][mutant.node].op in COLLECTIVES or draw.random() < 0.5:
        return mutant
    rank = draw.randrange(len(ranks))
    graphs = [mutated if r == rank else original
              for r, (original, mutated) in enumerate(zip(ranks, mutant.ranks))]
    return replace(mutant, what=f"{mutant.what} (rank {rank} only)", ranks=graphs)
