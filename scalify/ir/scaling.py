"""Scalar factors moved to where they matter: the same math scaled at another place is one graph.

Implementations scale where they like: a mean per rank, then the sum over ranks divided by the
world size (data parallel); a bucket divided before its reduce-scatter; a query scaled before
its product with the keys instead of the scores after it. The pass carries every scalar factor
(a `mul_scalar`, a `div_scalar`, a product with a uniform constant) forward through the ops that
are linear in it (data movement, sums, products, casts between floats, collectives that sum or
move) and writes it down, as one `mul_scalar`, only where a value enters an op that is not
linear in it or leaves the program. Factors are exact fractions, so `x / 8 / 2` and
`x * 0.0625` give the same node. A collective passes its inputs' factor only when every member
brings the same one; otherwise each member writes its factor down before the collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from ..errors import ScalifyError
from .distributed import (constant_values, link_point_to_point, match_collectives, qualified,
                          unqualified)
from .graph import Graph, Node, SourceLoc

SCALINGS = frozenset({"mul_scalar", "div_scalar"})  # the ops that scale by a Python scalar
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
ONE = Fraction(1)
_DENOMINATOR_LIMIT = 1 << 24  # 1/3 written as a float is the fraction 1/3

# Ops that pass one factor from the listed inputs to their output: all listed inputs must bring
# the same factor (a zero constant brings any). Unlisted inputs (indices, conditions) keep theirs.
SHARED_FACTOR: dict[str, tuple[int, ...]] = {
    **{op: (0,) for op in ("merge", "split", "unsqueeze", "squeeze", "transpose", "expand",
                           "slice", "sum", "neg", "embedding", "take", "index", "untake",
                           "embedding_grad", "all_gather", "all_to_all")},
    "add": (0, 1), "sub": (0, 1), "where": (1, 2), "concat": (),  # concat: every input
}
# Ops whose output's factor is the product of the listed inputs' factors.
PRODUCT_OF_FACTORS: dict[str, tuple[int, ...]] = {"matmul": (0, 1), "mul": (0, 1), "div": (0,)}


@dataclass(frozen=True)
class Scaled:
    """A value as `core * factor`; `source` is the last op that scaled it."""

    core: str
    factor: Fraction = ONE
    source: SourceLoc = SourceLoc()


def _fraction(value: float) -> Fraction | None:
    """The exact factor a Python scalar stands for (the simplest fraction that rounds to it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value == 0:
        return None
    exact = Fraction(value)
    simple = exact.limit_denominator(_DENOMINATOR_LIMIT)
    return simple if float(simple) == float(value) else exact


def _uniform(value: torch.Tensor | None) -> Fraction | None:
    """The single value of a floating constant whose elements are all equal (or None)."""
    if value is None or not value.is_floating_point() or value.numel() == 0:
        return None
    first = value.reshape(-1)[0]
    return _fraction(first.item()) if bool((value == first).all()) else None


@dataclass
class _Pusher:
    """One graph's pass; `blocked` names the collectives whose inputs write their factors down."""

    graph: Graph
    blocked: set[str]
    received: dict[str, Fraction] | None  # each recv's factor (None: sends write theirs down)
    out: Graph = field(default_factory=Graph)
    scaled: dict[str, Scaled] = field(default_factory=dict)
    written: dict[tuple[str, Fraction, str], str] = field(default_factory=dict)
    collective_factors: dict[str, Fraction] = field(default_factory=dict)  # by collective input

    def __post_init__(self) -> None:
        self.constants = constant_values(self.graph)
        self.nodes = {node.name: node for node in self.graph}

    def scales(self, node: Node) -> bool:
        """Whether the node scales a value by a factor (which the pass carries on)."""
        return node.name not in self.constants and (
            self._own_factor(node) is not None or self._uniform_operand(node) is not None)

    def run(self) -> Graph:
        for node in self.graph:
            if node.name in self.constants or node.op == "placeholder":
                self.scaled[node.name] = Scaled(self.out.add(node).name)
            else:
                self.scaled[node.name] = self._push(node)
        self.out.outputs = [self._written(name, "") for name in self.graph.outputs]
        return self.out

    def _floating(self, name: str) -> bool:
        return self.nodes[name].dtype in FLOATS

    def _push(self, node: Node) -> Scaled:
        if node.op == "recv" and self.received:
            return Scaled(self.out.add(node).name, self.received.get(node.name, ONE))
        factor = self._own_factor(node)
        if factor is not None:
            inner = self.scaled[node.inputs[0]]
            return Scaled(inner.core, inner.factor * factor, node.source)
        uniform = self._uniform_operand(node)
        if uniform is not None:
            index, factor = uniform
            inner = self.scaled[node.inputs[index]]
            return Scaled(inner.core, inner.factor * factor, node.source)
        return self._through(node)

    def _own_factor(self, node: Node) -> Fraction | None:
        """The factor of a `mul_scalar`/`div_scalar` on floats (None for any other node)."""
        if node.op not in SCALINGS or not (
                self._floating(node.inputs[0]) and node.dtype in FLOATS):
            return None
        value = _fraction(node.attr("value"))
        if value is None:
            return None
        return value if node.op == "mul_scalar" else 1 / value

    def _uniform_operand(self, node: Node) -> tuple[int, Fraction] | None:
        """(the varying operand, the factor) of a product with, or a quotient by, a constant of
        one value everywhere."""
        if node.op not in ("mul", "div") or node.dtype not in FLOATS:
            return None
        for index in ((0, 1) if node.op == "mul" else (0,)):
            constant = node.inputs[1 - index]
            value = _uniform(self.constants.get(constant)) if constant in self.constants else None
            if value is not None and node.inputs[index] not in self.constants and self._floating(
                    node.inputs[index]):
                return index, (value if node.op == "mul" else 1 / value)
        return None

    def _linear_inputs(self, node: Node) -> tuple[tuple[int, ...], bool]:
        """The inputs the node is linear in, and whether their factors multiply (else shared)."""
        if node.op in PRODUCT_OF_FACTORS:
            return PRODUCT_OF_FACTORS[node.op], True
        if node.op == "concat":
            return tuple(range(len(node.inputs))), False
        if node.op == "cast" and node.dtype in FLOATS and self._floating(node.inputs[0]):
            return (0,), False
        if node.op in ("pad", "masked_fill") and node.attr("value") == 0:
            return (0,), False
        if node.op == "send" and self.received is not None:
            return (0,), False
        if node.op in ("all_reduce", "reduce_scatter") and node.attr("reduce", "sum") == "sum":
            return self._collective_inputs(node)
        if node.op in ("all_gather", "all_to_all"):
            return self._collective_inputs(node)
        return SHARED_FACTOR.get(node.op, ()), False

    def _collective_inputs(self, node: Node) -> tuple[tuple[int, ...], bool]:
        self.collective_factors[node.inputs[0]] = self.scaled[node.inputs[0]].factor
        return ((), False) if node.name in self.blocked else ((0,), False)

    def _through(self, node: Node) -> Scaled:
        linear, multiply = self._linear_inputs(node)
        if node.dtype not in FLOATS:
            linear = ()
        varying = [i for i in linear if not self._is_zero(node.inputs[i])]
        if not multiply and len({self.scaled[node.inputs[i]].factor for i in varying}) > 1:
            linear = ()
        inputs, factor, source = [], ONE, SourceLoc()
        for index, name in enumerate(node.inputs):
            value = self.scaled[name]
            if index not in linear:
                inputs.append(self._written(name, node.source.module))
                continue
            inputs.append(value.core)
            if value.factor != ONE:  # (a shared factor is every varying input's factor)
                factor, source = (factor * value.factor if multiply else value.factor), value.source
        self.out.add(replace(node, inputs=tuple(inputs)))
        return Scaled(node.name, factor, source)

    def _is_zero(self, name: str) -> bool:
        """A constant whose elements are all zero: it takes any factor."""
        value = self.constants.get(name)
        return value is not None and not bool(value.any())

    def _written(self, name: str, module: str) -> str:
        """The node holding `name`'s value: its core, times its factor where that is not one.
        The product is written at the line that last scaled the value, in the module that uses
        it (`module`; "" for a program output), so that it falls in the user's region."""
        value = self.scaled[name]
        if value.factor == ONE:
            return value.core
        key = (value.core, value.factor, module)
        if key not in self.written:
            core = self.out[value.core]
            node = Node(f"{value.core}.x{len(self.written)}", "mul_scalar", (value.core,),
                        (("value", float(value.factor)),), core.shape, core.dtype,
                        replace(value.source, module=module))
            self.written[key] = self.out.add(node).name
        return self.written[key]


def scaling_nodes(graph: Graph) -> set[str]:
    """The nodes that scale a value by a factor: where the code as written and its moved form
    differ."""
    pusher = _Pusher(graph, set(), None)
    return {node.name for node in graph if pusher.scales(node)}


def pushed_scales(graphs: list[Graph]) -> list[Graph]:
    """The graphs (a program per rank, or the reference alone) with their scalar factors moved
    forward; a collective whose members bring different factors is passed no factor, and a recv
    takes the factor its peer's send carries (unless the sends and recvs do not pair up)."""
    try:
        links = link_point_to_point(graphs)
    except ScalifyError:  # merging the ranks reports it
        links = None
    blocked: set[tuple[int, str]] = set()
    received: list[dict[str, Fraction]] = [{} for _ in graphs]
    while True:
        pushers = [_Pusher(graph, {n for r, n in blocked if r == rank},
                           None if links is None else received[rank])
                   for rank, graph in enumerate(graphs)]
        pushed = [pusher.run() for pusher in pushers]
        disagreeing = _disagreeing(graphs, [pusher.collective_factors for pusher in pushers])
        sent = _received(links or {}, pushers, len(graphs))
        if disagreeing <= blocked and sent == received:
            return pushed
        blocked |= disagreeing
        received = sent


def _received(links: dict[str, str], pushers: list["_Pusher"], world: int
              ) -> list[dict[str, Fraction]]:
    """Per rank, each recv's factor: the one its peer's send input carries."""
    received: list[dict[str, Fraction]] = [{} for _ in range(world)]
    for recv, sent in links.items():
        (rank, name), (peer, value) = unqualified(recv), unqualified(sent)
        factor = pushers[peer].scaled[value].factor
        if factor != ONE:
            received[rank][name] = factor
    return received


def _disagreeing(graphs: list[Graph], factors: list[dict[str, Fraction]]) -> set[tuple[int, str]]:
    """The collectives (rank, name) whose members' inputs bring different factors (all of them
    when the collectives do not match up: merging the ranks reports that)."""
    try:
        partners = match_collectives(graphs)
    except ScalifyError:
        return {(rank, node.name) for rank, graph in enumerate(graphs) for node in graph
                if node.op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}
    disagreeing = set()
    for rank, graph in enumerate(graphs):
        for node in graph:
            members = partners.get(qualified(rank, node.name))
            if members and len({factors[m].get(i, ONE) for m, i in members[0]}) > 1:
                disagreeing.add((rank, node.name))
    return disagreeing
