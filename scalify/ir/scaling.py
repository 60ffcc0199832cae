"""Scalar factors moved to where they matter: the same math scaled at another place is one graph.

Implementations scale where they like: a mean per rank, then the sum over ranks divided by the
world size (data parallel); a bucket divided before its reduce-scatter; a query scaled before
its product with the keys instead of the scores after it. The pass carries every scalar factor
(a `mul_scalar`, a `div_scalar`, a product with a uniform constant) forward through the ops that
are linear in it (data movement, sums, products, casts between floats, collectives that sum or
move) and writes it down, as one `mul_scalar`, only where a value enters an op that is not
linear in it or leaves the program. Factors are exact fractions, so `x / 8 / 2` and
`x * 0.0625` give the same node. Factors are carried as sizes: a negative one leaves its sign
as a negation where it was applied, so code that negates before or after it scales (or scales
by a negative constant) carries the same factor. A collective passes its inputs' factor only when every member
brings the same one; otherwise each member writes its factor down before the collective.
"""
from __future__ import annotations

import math
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
_PRODUCT_TOLERANCE = Fraction(1, 1 << 50)  # relative: a product of rounded factors, 4 ulps

# Ops that pass one factor from the listed inputs to their output: all listed inputs must bring
# the same factor (a zero constant brings any). Unlisted inputs (indices, conditions) keep theirs.
SHARED_FACTOR: dict[str, tuple[int, ...]] = {
    **{op: (0,) for op in ("merge", "split", "unsqueeze", "squeeze", "transpose", "expand",
                           "slice", "sum", "neg", "embedding", "take", "index", "untake",
                           "embedding_grad", "all_gather", "all_to_all")},
    "add": (0, 1), "sub": (0, 1), "where": (1, 2), "concat": (),  # concat: every input
}
# Collectives: a bucket enters one with each part's factor written (every member's must agree).
_EXCHANGES = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"})
# Ops a bucket enters with each part's factor written: the collectives, and a slice across parts
# (the shard of a flat buffer a rank owns).
_PARTS_WRITTEN = _EXCHANGES | {"slice"}
# Ops whose output's factor is the product of the listed inputs' factors.
PRODUCT_OF_FACTORS: dict[str, tuple[int, ...]] = {"matmul": (0, 1), "mul": (0, 1), "div": (0,)}


@dataclass(frozen=True)
class Scaled:
    """A value as `core * factor`; `source` is the last op that scaled it. A concat of values
    with different factors (a bucket of gradients) keeps each part's: `parts` are the parts'
    sizes along dim `dim` and their factors (times `factor`), until a slice takes one part."""

    core: str
    factor: Fraction = ONE
    source: SourceLoc = SourceLoc()
    parts: tuple[tuple[int, Fraction], ...] = ()
    dim: int = 0

    def key(self) -> tuple:
        """What the members of a collective must agree on."""
        return self.factor, self.parts, self.dim


def exact_fraction(value: float) -> Fraction | None:
    """The exact factor a Python scalar stands for (the simplest fraction that rounds to it)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value == 0
            or not math.isfinite(value)):
        return None
    exact = Fraction(value)
    simple = exact.limit_denominator(_DENOMINATOR_LIMIT)
    return simple if float(simple) == float(value) else exact


def power_of_scalar(value: float, power: float) -> float:
    """`value ** power` for a scaling raised with what it scales (DTensor's share of a norm,
    `x / 2 ** 0.5`, squared): an integer power of the exact factor, snapped like a product of
    factors (`(2 ** 0.5) ** 2` is 2, as the math written means, not the float 2.0000000000000004)."""
    factor = exact_fraction(value)
    if factor is None or power != int(power):
        return value ** power
    return float(_snapped(factor ** int(power)))


def _snapped(factor: Fraction) -> Fraction:
    """A product of factors as the simplest fraction within a few float64 ulps of it, if one
    is: a scale applied as its square root to both operands of a product (as PyTorch's
    attention does to the query and the key) is that scale, as the math written means."""
    simple = factor.limit_denominator(_DENOMINATOR_LIMIT)
    return simple if abs(simple - factor) <= abs(factor) * _PRODUCT_TOLERANCE else factor


def scalar_factor(node: Node) -> Fraction | None:
    """The factor a `mul_scalar` or `div_scalar` scales by (None for other nodes)."""
    value = exact_fraction(node.attr("value")) if node.op in SCALINGS else None
    if value is None:
        return None
    return value if node.op == "mul_scalar" else 1 / value


def _uniform(value: torch.Tensor | None) -> Fraction | None:
    """The single value of a floating constant whose elements are all equal (or None)."""
    if value is None or not value.is_floating_point() or value.numel() == 0:
        return None
    first = value.reshape(-1)[0]
    return exact_fraction(first.item()) if bool((value == first).all()) else None


@dataclass
class _Pusher:
    """One graph's pass; `blocked` names the collectives whose inputs write their factors down."""

    graph: Graph
    blocked: set[str]
    received: dict[str, Fraction] | None  # each recv's factor (None: sends write theirs down)
    out: Graph = field(default_factory=Graph)
    scaled: dict[str, Scaled] = field(default_factory=dict)
    written: dict[tuple, str] = field(default_factory=dict)
    collective_factors: dict[str, tuple] = field(default_factory=dict)  # Scaled.key by input
    units: set[str] = field(default_factory=set)  # the ones that stand for uniform constants

    def __post_init__(self) -> None:
        self.constants = constant_values(self.graph)
        self.nodes = {node.name: node for node in self.graph}

    def scales(self, node: Node) -> bool:
        """Whether the node scales a value by a factor (which the pass carries on), or reads a
        constant of one value other than 0 and 1 (a factor the pass carries from there)."""
        return node.name not in self.constants and (
            self._own_factor(node) is not None or self._uniform_operand(node) is not None
            or any(self._unit_factor(name) is not None for name in node.inputs))

    def run(self) -> Graph:
        for node in self.graph:
            if node.name in self.constants or node.op == "placeholder":
                self.out.add(node)
                self.scaled[node.name] = self._constant(node)
            else:
                self.scaled[node.name] = self._push(node)
        self.out.outputs = [self._written(self.scaled[name], "") for name in self.graph.outputs]
        return _without_unused(self.out, self.units)

    def _unit_factor(self, name: str) -> Fraction | None:
        """The value of a floating constant of one value other than 0, 1 and -1, else None."""
        value = _uniform(self.constants.get(name)) if self._floating(name) else None
        return None if value in (None, ONE, -ONE) else value

    def _constant(self, node: Node) -> Scaled:
        """A constant (or placeholder) as it is; one of a single value v (not 0, 1 or -1) is
        also, for the ops that read it, ones (or minus ones) times |v|: a per-rank mean's 1/n
        that a gradient carries from the loss."""
        factor = self._unit_factor(node.name)
        if factor is None:
            return Scaled(node.name)
        sign = 1.0 if factor > 0 else -1.0
        unit = Node(f"{node.name}.unit", "full", (), (("dtype", node.dtype), ("shape", node.shape),
                                                        ("value", sign)), node.shape, node.dtype,
                    node.source)
        self.units.add(self.out.add(unit).name)
        return Scaled(unit.name, abs(factor), node.source)

    def _floating(self, name: str) -> bool:
        return self.nodes[name].dtype in FLOATS

    def _push(self, node: Node) -> Scaled:
        if node.op == "recv" and self.received:
            return Scaled(self.out.add(node).name, self.received.get(node.name, ONE))
        factor = self._own_factor(node)
        if factor is not None:
            return self._scaled_by(node, self.scaled[node.inputs[0]], factor)
        uniform = self._uniform_operand(node)
        if uniform is not None:
            index, factor = uniform
            return self._scaled_by(node, self.scaled[node.inputs[index]], factor)
        parted = self._parted(node)
        return parted if parted is not None else self._through(node)

    def _scaled_by(self, node: Node, inner: Scaled, factor: Fraction) -> Scaled:
        """`inner` scaled by `node`'s factor: its size carried on, its sign kept at the node as
        a negation (so `-(x / 12)`, `x * (-1 / 12)` and `x / 12` negated later carry 1/12 alike)."""
        core = inner.core
        if factor < 0:
            held = self.out[core]
            core = self.out.add(Node(node.name, "neg", (core,), (), held.shape, held.dtype,
                                     node.source)).name
        return replace(inner, core=core, factor=inner.factor * abs(factor),
                       source=_scaled_again(node.source, inner))

    def _parted(self, node: Node) -> Scaled | None:
        """A bucket of parts with their own factors: made by a concat of values whose factors
        differ, summed over ranks as it is, and a part taken back by a slice (None: the node
        does none of this)."""
        inner = self.scaled[node.inputs[0]] if node.inputs else None
        if node.op == "concat" and node.dtype in FLOATS:
            values = [self.scaled[name] for name in node.inputs]
            dim = node.attr("dim") % len(node.shape)
            factors = {value.factor for name, value in zip(node.inputs, values)
                       if not self._is_zero(name)}  # (padding takes any factor)
            if (len(factors) < 2 and not any(v.parts for v in values)
                    or any(value.parts and value.dim != dim for value in values)):
                return None
            self.out.add(replace(node, inputs=tuple(value.core for value in values)))
            parts = tuple(part for name, value in zip(node.inputs, values) for part in (
                [(size, value.factor * factor) for size, factor in value.parts] if value.parts
                else [(self.nodes[name].shape[dim], value.factor)]))
            return Scaled(node.name, ONE, values[-1].source, parts, dim)
        if inner is None or not inner.parts:
            return None
        if (node.op == "all_reduce" and node.attr("reduce", "sum") == "sum"
                and node.name not in self.blocked):
            self.collective_factors[node.inputs[0]] = inner.key()
            self.out.add(replace(node, inputs=(inner.core,)))
            return replace(inner, core=node.name)
        if node.op == "slice" and node.attr("dim") % len(node.shape) == inner.dim:
            start = 0
            for size, factor in inner.parts:
                if start <= node.attr("start") and node.attr("end") <= start + size:
                    self.out.add(replace(node, inputs=(inner.core,)))
                    return Scaled(node.name, inner.factor * factor, inner.source)
                start += size
        return None

    def _own_factor(self, node: Node) -> Fraction | None:
        """The factor of a `mul_scalar`/`div_scalar` on floats (None for any other node)."""
        if node.op not in SCALINGS or not (
                self._floating(node.inputs[0]) and node.dtype in FLOATS):
            return None
        return scalar_factor(node)

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
        if (node.op == "masked_fill" and node.attr("value") in (math.inf, -math.inf)
                and self.scaled[node.inputs[0]].factor > 0):  # (a causal mask of scores)
            return (0,), False
        if node.op == "send" and self.received is not None:
            return (0,), False
        if node.op in ("all_reduce", "reduce_scatter") and node.attr("reduce", "sum") == "sum":
            return self._collective_inputs(node)
        if node.op in ("all_gather", "all_to_all"):
            return self._collective_inputs(node)
        return SHARED_FACTOR.get(node.op, ()), False

    def _collective_inputs(self, node: Node) -> tuple[tuple[int, ...], bool]:
        self.collective_factors[node.inputs[0]] = self.scaled[node.inputs[0]].key()
        return ((), False) if node.name in self.blocked else ((0,), False)

    def _through(self, node: Node) -> Scaled:
        """The node on its inputs' cores, carrying their factor: the product of the factors of
        the inputs it multiplies, or the factor the inputs it adds share. Where those differ
        (`x - mean(x)`: f and f/n), the first one's is carried and the others are written as
        their ratio to it (1/n), so a factor every term brings passes on. The parts of a concat
        keep their own (a bucket of gradients is sliced apart again), and enter a slice across
        them or a collective written whole; a bucket that enters another op (a merge across its
        parts, a matmul) passes its first part's factor on, the parts written as their ratio to
        it, so a factor every part brings, or one applied after, passes on (a weight gradient of
        fused q, k and v pieces scaled apart)."""
        linear, multiply = self._linear_inputs(node)
        module = node.source.module
        if node.dtype not in FLOATS:
            linear = ()
        values = [self._led(self.scaled[name], module)
                  if index in linear and node.op not in _PARTS_WRITTEN else self.scaled[name]
                  for index, name in enumerate(node.inputs)]
        linear = tuple(i for i in linear if not values[i].parts)  # (written whole)
        varying = [i for i in linear if not self._is_zero(node.inputs[i])]
        factors = {values[i].factor for i in varying}
        if node.op == "concat" and len(factors) > 1:
            linear, varying = (), []
        shared = ONE if multiply or not varying else values[varying[0]].factor
        inputs, factor, source = [], ONE if multiply else shared, SourceLoc()
        for index, value in enumerate(values):
            if index not in linear:
                inputs.append(self._written(self.scaled[node.inputs[index]], module))
            elif multiply or index not in varying:
                inputs.append(value.core)
                factor *= value.factor if multiply else ONE
            else:
                inputs.append(self._written(value, module, shared))
            if index in linear and value.factor != ONE and not source.file:
                source = value.source
        self.out.add(replace(node, inputs=tuple(inputs)))
        return Scaled(node.name, _snapped(factor), source)

    def _led(self, value: Scaled, module: str) -> Scaled:
        """A bucket as its parts written over its first part's factor, which it carries on."""
        if not value.parts:
            return value
        lead = value.factor * value.parts[0][1]
        return Scaled(self._written_parts(value, module, lead), lead, value.source)

    def _written_parts(self, value: Scaled, module: str, carried: Fraction = ONE) -> str:
        """A bucket's value over `carried`: each part sliced from its core, times its factor
        divided by `carried`, joined again."""
        key = (value.core, value.key(), module, carried)
        if key not in self.written:
            core, start, pieces = self.out[value.core], 0, []
            prefix = f"{value.core}.w{len(self.written)}"
            for k, (size, factor) in enumerate(value.parts):
                piece = self.out.add(_piece(f"{prefix}.{k}", core, value.dim, start, start + size))
                factor *= value.factor / carried
                if factor != ONE:
                    piece = self.out.add(Node(f"{prefix}.{k}x", "mul_scalar", (piece.name,),
                                              (("value", float(factor)),), piece.shape,
                                              piece.dtype, replace(value.source, module=module)))
                pieces.append(piece.name)
                start += size
            self.written[key] = self.out.add(Node(prefix, "concat", tuple(pieces),
                                                  (("dim", value.dim),), core.shape, core.dtype,
                                                  core.source)).name
        return self.written[key]

    def _is_zero(self, name: str) -> bool:
        """A constant whose elements are all zero: it takes any factor."""
        value = self.constants.get(name)
        return value is not None and not bool(value.any())

    def _written(self, value: Scaled, module: str, carried: Fraction = ONE) -> str:
        """The node holding `value` over the factor `carried` on: its core, times its factor
        divided by `carried` where that is not one. The product is written at the line that
        last scaled the value, in the module that uses it (`module`; "" for a program output),
        so that it falls in the user's region."""
        if value.parts:
            return self._written_parts(value, module, carried)
        factor = value.factor / carried
        if factor == ONE:
            return value.core
        key = (value.core, factor, module)
        if key not in self.written:
            core = self.out[value.core]
            node = Node(f"{value.core}.x{len(self.written)}", "mul_scalar", (value.core,),
                        (("value", float(factor)),), core.shape, core.dtype,
                        replace(value.source, module=module))
            self.written[key] = self.out.add(node).name
        return self.written[key]


def _scaled_again(source: SourceLoc, earlier: Scaled) -> SourceLoc:
    """`source`, naming the lines that scaled the value before it: their factors are written
    down at `source` with its own."""
    if earlier.factor == ONE or not earlier.source.file:
        return source
    here = f"{source.file}:{source.line}"
    lines = (f"{earlier.source.file}:{earlier.source.line}", *earlier.source.scaled_at)
    return replace(source, scaled_at=tuple(dict.fromkeys(line for line in lines if line != here)))


def _piece(name: str, core: Node, dim: int, start: int, end: int) -> Node:
    shape = core.shape[:dim] + (end - start,) + core.shape[dim + 1:]
    return Node(name, "slice", (core.name,), (("dim", dim), ("end", end), ("start", start)), shape,
                core.dtype, core.source)


def _without_unused(graph: Graph, names: set[str]) -> Graph:
    """The graph without those of `names` that no node reads and no output is."""
    used = set(graph.outputs).union(*(node.inputs for node in graph))
    if names <= used:
        return graph
    kept = Graph(outputs=list(graph.outputs))
    for node in graph:
        if node.name in used or node.name not in names:
            kept.add(node)
    return kept


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


def _disagreeing(graphs: list[Graph], factors: list[dict[str, tuple]]) -> set[tuple[int, str]]:
    """The collectives (rank, name) whose members' inputs bring different factors (all of them
    when the collectives do not match up: merging the ranks reports that)."""
    try:
        partners = match_collectives(graphs)
    except ScalifyError:
        return {(rank, node.name) for rank, graph in enumerate(graphs) for node in graph
                if node.op in _EXCHANGES}
    disagreeing = set()
    for rank, graph in enumerate(graphs):
        for node in graph:
            members = partners.get(qualified(rank, node.name))
            if members and len({factors[m].get(i, Scaled("").key()) for m, i in members[0]}) > 1:
                disagreeing.add((rank, node.name))
    return disagreeing
