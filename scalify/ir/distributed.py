"""Merges per-rank graphs into one distributed graph whose collectives read every member's input
and whose received tensors are the tensors their peers sent (send/recv become identity edges)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import torch

from ..errors import ScalifyError
from .graph import Graph, Node, SourceLoc
from .ops import OPS, RANDOM

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_SHAPES_MAY_DIFFER = ("all_to_all",)  # each rank receives its own blocks
POINT_TO_POINT = ("send", "recv")


@dataclass
class DistributedGraph:
    """All ranks in one graph; node names are `r{rank}/{local name}`."""

    graph: Graph
    world_size: int
    rank_outputs: list[list[str]]
    order: dict[str, tuple[int, int]]  # (rank, position in that rank's program): a canonical order
    symbolic: bool = False  # one program stands for every rank (see ir/symmetry.py)
    # the lines of the sends that carried each sent tensor to other ranks (the edges that
    # replace send and recv have no line of their own)
    sent_at: dict[str, tuple[SourceLoc, ...]] = field(default_factory=dict)

    def rank_of(self, name: str) -> int:
        return int(name[1:name.index("/")])


def qualified(rank: int, name: str) -> str:
    return f"r{rank}/{name}"


def unqualified(name: str) -> tuple[int, str]:
    """(rank, node name) of a qualified name."""
    rank, _, local = name.partition("/")
    return int(rank[1:]), local


def merge_ranks(graphs: list[Graph]) -> DistributedGraph:
    """Match each rank's k-th collective on a group with the other members' k-th, link each recv
    to its peer's send, and merge."""
    partners = match_collectives(graphs)
    sent = link_point_to_point(graphs)

    def source(rank: int, name: str) -> str:
        return sent.get(qualified(rank, name), qualified(rank, name))

    nodes: dict[str, Node] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            name = qualified(rank, node.name)
            if node.op in POINT_TO_POINT:
                continue
            if name in partners:
                members, index, extra = partners[name]
                node = replace(node, inputs=tuple(qualified(m, i) for m, i in members),
                               attrs=node.attrs + (("index", index),) + extra)
            else:
                node = replace(node, inputs=tuple(source(rank, i) for i in node.inputs))
            nodes[name] = replace(node, name=name)
    rank_outputs = [[source(r, o) for o in g.outputs] for r, g in enumerate(graphs)]
    merged = Graph(outputs=[o for outs in rank_outputs for o in outs])
    for node in _topological(graphs, nodes):
        merged.add(node)
    order = {qualified(r, node.name): (r, i) for r, g in enumerate(graphs)
             for i, node in enumerate(g.nodes)}
    sent_at: dict[str, tuple[SourceLoc, ...]] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            if node.op == "send":
                tensor = source(rank, node.inputs[0])
                sent_at[tensor] = sent_at.get(tensor, ()) + (node.source,)
    return DistributedGraph(merged, len(graphs), rank_outputs, order, sent_at=sent_at)


def link_point_to_point(graphs: list[Graph]) -> dict[str, str]:
    """For each recv (qualified name), the qualified tensor its peer sends: the k-th send from
    rank a to rank b is the k-th recv on b from a. A send or recv without its match is an
    error naming its source line (the ranks would hang)."""
    sends: dict[tuple[int, int], list[Node]] = {}
    recvs: dict[tuple[int, int], list[Node]] = {}
    for rank, graph in enumerate(graphs):
        for node in graph:
            peer = node.attr("peer") if node.op in POINT_TO_POINT else None
            if peer is not None and not 0 <= peer < len(graphs):
                raise ScalifyError(f"{node.source}: rank {rank} {node.op}s with rank {peer}, "
                                   f"outside the world of {len(graphs)} ranks")
            if node.op == "send":
                sends.setdefault((rank, peer), []).append(node)
            elif node.op == "recv":
                recvs.setdefault((peer, rank), []).append(node)
    links = {}
    for a, b in sorted(sends.keys() | recvs.keys()):
        out, into = sends.get((a, b), []), recvs.get((a, b), [])
        for k in range(max(len(out), len(into))):
            if k >= len(into):
                raise ScalifyError(f"{out[k].source}: send #{k} from rank {a} to rank {b} has no "
                                   f"matching recv on rank {b} (ranks would hang)")
            if k >= len(out):
                raise ScalifyError(f"{into[k].source}: recv #{k} on rank {b} from rank {a} has no "
                                   f"matching send on rank {a} (ranks would hang)")
            if out[k].shape != into[k].shape:
                raise ScalifyError(f"{into[k].source}: recv #{k} on rank {b} expects shape "
                                   f"{list(into[k].shape)} but rank {a} sends "
                                   f"{list(out[k].shape)} at {out[k].source}")
            links[qualified(b, into[k].name)] = qualified(a, out[k].inputs[0])
    return {recv: _first_sender(links, recv) for recv in links}


def _first_sender(links: dict[str, str], recv: str) -> str:
    """The tensor a chain of forwards started from: a rank that sends on what it received (a
    ring passing blocks along) sends its peer's tensor."""
    seen = {recv}
    tensor = links[recv]
    while tensor in links:
        if tensor in seen:
            raise ScalifyError(f"received tensors forward each other in a cycle at {tensor}")
        seen.add(tensor)
        tensor = links[tensor]
    return tensor


def match_collectives(graphs: list[Graph]) -> dict[str, tuple[list[tuple[int, str]], int, tuple]]:
    """Each collective's members (rank, input) in group order (an all_reduce's in rank order), its
    position in the group, and the attributes it needs from its members (an all_to_all: every
    member's `in_splits`)."""
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
            if node.op == "all_reduce":  # a sum or max over a set: the listed order is no matter
                members.sort()
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
                node = nodes.get(qualified(rank, graph.nodes[positions[rank]].name))
                if node is None:  # a send or recv: linked, not kept
                    positions[rank] += 1
                    progressed = True
                    continue
                if not all(i in done for i in node.inputs):
                    break
                ordered.append(node)
                done.add(node.name)
                positions[rank] += 1
                progressed = True
        if not progressed:
            raise ScalifyError("the ranks' collectives cannot be ordered consistently (deadlock)")
    return ordered


_VALUE_KEY_LIMIT = 1 << 22  # elements: larger constants are keyed by structure alone
_PLAIN = (int, float, str, bool, tuple, type(None))


def constant_values(graph: Graph) -> dict[str, torch.Tensor | None]:
    """Every node that depends on no placeholder, collective, receive or random draw (the same
    value on every rank), with its value where the interpreter can compute it, else None."""
    values: dict[str, torch.Tensor | None] = {}
    for node in graph:
        if (node.op in ("placeholder", "opaque", "recv") or node.op in COLLECTIVES
                or OPS[node.op].trait == RANDOM):  # (a draw differs by call and by rank)
            continue
        if all(i in values for i in node.inputs):
            values[node.name] = _constant_value(node, [values[i] for i in node.inputs])
    return values


def constant_keys(graph: Graph, values: dict[str, torch.Tensor | None] | None = None
                  ) -> dict[str, str]:
    """A key for every constant node (`constant_values`, or the `values` given): a hash of its
    value where the interpreter can compute it (so `x.t().t()` or an operand order makes no
    difference), else a hash of its structure."""
    values = constant_values(graph) if values is None else values
    keys: dict[str, str] = {}
    for node in graph:
        if node.name not in values:
            continue
        if node.op == "add_scalar" and node.attr("value") == 0:
            keys[node.name] = keys[node.inputs[0]]  # x + 0 (positions after no cached tokens)
            continue
        value = values[node.name]
        if value is None:
            content = repr((node.op, node.attrs, node.shape, node.dtype,
                            [keys[i] for i in node.inputs])).encode()
            keys[node.name] = hashlib.sha1(content).hexdigest()[:16]
        else:
            keys[node.name] = value_key(node.shape, node.dtype, value)
    return keys


def value_key(shape: tuple[int, ...], dtype: str, value: torch.Tensor) -> str:
    content = repr((shape, dtype)).encode() + value.reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(content).hexdigest()[:16]


def _uniform_broadcast(node: Node, value: torch.Tensor | None) -> str | None:
    """A constant of one value everywhere as the broadcast of that value (`torch.full` of the
    whole batch's heads and of a rank's heads then relate), or None."""
    if value is None or value.numel() <= 1:
        return None
    first = value.reshape(-1)[:1]
    if not bool((value == first).all()):
        return None
    ones = (1,) * len(node.shape)
    term = f'(const "{value_key(ones, node.dtype, first.reshape(ones))}")'
    for dim, size in enumerate(node.shape):
        if size != 1:
            term = f"(expand {term} {dim} {size})"
    return term


def _constant_value(node: Node, inputs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The node's value, or None when an input has none, the node is large, an attribute is
    symbolic (a rank-dependent integer) or the interpreter cannot run it as captured."""
    if any(i is None for i in inputs) or math.prod(node.shape) > _VALUE_KEY_LIMIT or any(
            not isinstance(value, _PLAIN) for _, value in node.attrs):
        return None
    try:
        value = OPS[node.op].run(inputs, dict(node.attrs)).contiguous()
    except Exception:  # an op the interpreter lacks or refuses on these values: structure only
        return None
    return value if tuple(value.shape) == node.shape else None


def constant_terms(graph: Graph, values: dict[str, torch.Tensor | None] | None = None
                   ) -> dict[str, str]:
    """The egglog term of every node that depends on no placeholder: a `(const "key")` leaf,
    except that a constant of one value everywhere is the broadcast of that value, however it
    was built (so a constant the size of the whole batch relates to each rank's smaller one),
    and other broadcasts of constants stay `expand`/`unsqueeze` terms. Any other node with the value of an earlier one gets
    that one's term. `values`: `constant_values(graph)` where already computed."""
    values = constant_values(graph) if values is None else values
    keys = constant_keys(graph, values)
    terms: dict[str, str] = {}
    by_key: dict[str, str] = {}
    for node in graph:
        if node.name not in keys:
            continue
        inner = terms.get(node.inputs[0]) if node.inputs else None
        key = keys[node.name]
        uniform = _uniform_broadcast(node, values[node.name])
        if uniform is not None:  # however it was built
            terms[node.name] = by_key[key] = uniform
        elif node.op == "expand" and inner:
            terms[node.name] = by_key[key] = f"(expand {inner} {node.attr('dim')} {node.attr('size')})"
        elif node.op == "unsqueeze" and inner:
            terms[node.name] = by_key[key] = f"(unsqueeze {inner} {node.attr('dim')})"
        else:
            terms[node.name] = by_key.setdefault(key, f'(const "{key}")')
    return terms
