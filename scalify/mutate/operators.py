"""Mutation operators: small functions from one IR node to the changes that plant a bug there,
and number-preserving rewrites (the equivalent mutants a verifier must not flag).

A change rewrites the node on every rank (so collectives still match across ranks): into
replacement nodes, the last of which keeps the node's name, or into the name of a tensor its
users read instead (the node is dropped).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..ir.graph import Node
from ..rules.families import COMMUTATIVE

Rewrite = list[Node] | str  # replacement nodes, or the name the node's users read instead


@dataclass(frozen=True)
class Change:
    """One mutation at one node: what it does, and how it rewrites that node on rank `r`."""

    node: str
    what: str
    rewrite: Callable[[int, Node], Rewrite]


Operator = Callable[[Node, int], list[Change]]


def _with(node: Node, **attrs: object) -> Node:
    """The node with some attributes replaced (or added)."""
    kept = tuple((k, v) for k, v in node.attrs if k not in attrs)
    return replace(node, attrs=kept + tuple(attrs.items()))


def _group(node: Node, world: int) -> tuple[int, ...]:
    return tuple(node.attr("group") or range(world))


def _same(changed: Node) -> Callable[[int, Node], Rewrite]:
    """A rewrite that is the same node on every rank."""
    return lambda rank, node: [changed]


def drop_collective(node: Node, world: int) -> list[Change]:
    """Skip the communication: an all_reduce becomes its input, an all_gather a concat of the
    local input with itself, a reduce_scatter the local slice of its unreduced input."""
    size = len(_group(node, world))
    if node.op == "all_reduce":
        return [Change(node.name, "all_reduce -> its input", lambda r, n: n.inputs[0])]
    if node.op == "all_gather":
        concat = Node(node.name, "concat", node.inputs * size, (("dim", 0),), node.shape,
                      node.dtype, node.source)
        return [Change(node.name, "all_gather -> local concat", _same(concat))]
    if node.op == "reduce_scatter":
        dim = node.attr("dim", 0)

        def local_slice(rank: int, n: Node) -> Rewrite:
            index, width = _group(n, world).index(rank), n.shape[dim]
            attrs = (("dim", dim), ("start", index * width), ("end", (index + 1) * width))
            return [Node(n.name, "slice", n.inputs, attrs, n.shape, n.dtype, n.source)]

        return [Change(node.name, "reduce_scatter -> local slice", local_slice)]
    return []


def duplicate_collective(node: Node, world: int) -> list[Change]:
    """Run an all_reduce twice."""
    if node.op != "all_reduce":
        return []
    first = replace(node, name=f"{node.name}.dup")
    return [Change(node.name, "all_reduce twice",
                   lambda r, n: [replace(first, inputs=n.inputs), replace(n, inputs=(first.name,))])]


def swap_reduce_op(node: Node, world: int) -> list[Change]:
    """sum <-> max in an all_reduce."""
    if node.op != "all_reduce":
        return []
    other = "max" if node.attr("reduce") == "sum" else "sum"
    return [Change(node.name, f"reduce {node.attr('reduce')} -> {other}",
                   _same(_with(node, reduce=other)))]


def change_group(node: Node, world: int) -> list[Change]:
    """An all_reduce over the half of the ranks holding this rank; a gather or scatter over
    the group in reverse order."""
    group = _group(node, world)
    if node.op == "all_reduce" and len(group) >= 2:
        half = len(group) // 2

        def halves(rank: int, n: Node) -> Rewrite:
            position = group.index(rank)
            members = group[:half] if position < half else group[half:]
            return [_with(n, group=members)]

        return [Change(node.name, f"group {list(group)} -> its halves", halves)]
    if node.op in ("all_gather", "reduce_scatter") and len(group) >= 2:
        flipped = tuple(reversed(group))
        return [Change(node.name, f"group {list(group)} -> {list(flipped)}",
                       _same(_with(node, group=flipped)))]
    return []


def shift_slice(node: Node, world: int) -> list[Change]:
    """Move a slice window (or a pad's split between before and after) by one element."""
    changes = []
    for step in (-1, 1):
        if node.op == "slice":
            moved = _with(node, start=node.attr("start") + step, end=node.attr("end") + step)
            changes.append(Change(node.name, f"slice bounds {step:+d}", _same(moved)))
        elif node.op == "pad" and node.attr("before") + step >= 0 and node.attr("after") - step >= 0:
            moved = _with(node, before=node.attr("before") + step, after=node.attr("after") - step)
            changes.append(Change(node.name, f"pad offset {step:+d}", _same(moved)))
    return changes


_SCALARS = ("mul_scalar", "div_scalar", "add_scalar", "rsub_scalar", "pow_scalar")


def scale_constant(node: Node, world: int) -> list[Change]:
    """A scalar constant doubled (a float) or moved by one (an integer or a zero)."""
    value = node.attr("value")
    if node.op not in _SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    changed = value * 2 if isinstance(value, float) and value else value + 1
    return [Change(node.name, f"{node.op} {value} -> {changed}", _same(_with(node, value=changed)))]


_DIM_OPS = ("sum", "amax", "logsumexp", "softmax", "log_softmax", "concat")


def change_reduction_dim(node: Node, world: int) -> list[Change]:
    """Reduce (or normalise, or concatenate) along another dim."""
    if node.op not in _DIM_OPS:
        return []
    rank = len(node.shape)
    dim = node.attr("dim") % rank
    return [Change(node.name, f"{node.op} dim {dim} -> {other}", _same(_with(node, dim=other)))
            for other in range(rank) if other != dim]


def change_permutation(node: Node, world: int) -> list[Change]:
    """Transpose another pair of dims, or drop the transpose."""
    if node.op != "transpose":
        return []
    rank = len(node.shape)
    current = {node.attr("dim0") % rank, node.attr("dim1") % rank}
    changes = [Change(node.name, f"transpose {sorted(current)} -> {[a, b]}",
                      _same(_with(node, dim0=a, dim1=b)))
               for a in range(rank) for b in range(a + 1, rank) if {a, b} != current]
    changes.append(Change(node.name, "transpose dropped", lambda r, n: n.inputs[0]))
    return changes


_NON_COMMUTATIVE = ("sub", "div", "pow", "matmul", "lt", "le", "gt", "ge")


def _reversed_inputs(rank: int, node: Node) -> Rewrite:
    return [replace(node, inputs=node.inputs[::-1])]


def swap_operands(node: Node, world: int) -> list[Change]:
    """Swap the operands of a non-commutative binary op (or a where's two branches)."""
    if node.op in _NON_COMMUTATIVE:
        return [Change(node.name, f"{node.op} operands swapped", _reversed_inputs)]
    if node.op == "where":
        return [Change(node.name, "where branches swapped",
                       lambda r, n: [replace(n, inputs=(n.inputs[0], n.inputs[2], n.inputs[1]))])]
    return []


_SIBLINGS = {"gelu": "silu", "silu": "gelu", "exp": "sigmoid", "sigmoid": "exp",
             "tanh": "sigmoid", "relu": "gelu", "sin": "cos", "cos": "sin", "rsqrt": "sqrt",
             "sqrt": "rsqrt", "neg": "abs", "softmax": "log_softmax", "log_softmax": "softmax",
             "sum": "amax", "amax": "sum", "add": "sub", "sub": "add", "mul": "div",
             "maximum": "minimum", "minimum": "maximum"}


def replace_sibling(node: Node, world: int) -> list[Change]:
    """An op replaced by a sibling of the same shape (gelu <-> silu, exp <-> sigmoid, ...)."""
    sibling = _SIBLINGS.get(node.op)
    if sibling is None:
        return []
    return [Change(node.name, f"{node.op} -> {sibling}", _same(replace(node, op=sibling)))]


def commute_operands(node: Node, world: int) -> list[Change]:
    """Swap the operands of a commutative binary op (numbers unchanged)."""
    if node.op not in COMMUTATIVE or node.inputs[0] == node.inputs[1]:
        return []
    return [Change(node.name, f"{node.op} operands commuted", _reversed_inputs)]


def _renamed(node: Node) -> Node:
    """The node under a fresh name, for a rewrite that puts ops after it."""
    return replace(node, name=f"{node.name}.kept")


def transpose_twice(node: Node, world: int) -> list[Change]:
    """Transpose a result's last two dims and back (numbers unchanged)."""
    if node.op == "placeholder" or len(node.shape) < 2:
        return []
    rank = len(node.shape)
    dims = (("dim0", rank - 2), ("dim1", rank - 1))
    swapped = node.shape[:-2] + (node.shape[-1], node.shape[-2])

    def twice(r: int, n: Node) -> Rewrite:
        kept = _renamed(n)
        there = Node(f"{n.name}.transposed", "transpose", (kept.name,), dims, swapped, n.dtype,
                     n.source)
        return [kept, there, Node(n.name, "transpose", (there.name,), dims, n.shape, n.dtype,
                                  n.source)]

    return [Change(node.name, "transposed twice", twice)]


def split_and_rejoin(node: Node, world: int) -> list[Change]:
    """Cut a result in two along its last dim and concatenate the halves (numbers unchanged)."""
    if node.op == "placeholder" or not node.shape or node.shape[-1] < 2:
        return []
    dim, size = len(node.shape) - 1, node.shape[-1]
    cut = size // 2

    def rejoined(r: int, n: Node) -> Rewrite:
        kept = _renamed(n)
        halves = [Node(f"{n.name}.{part}", "slice", (kept.name,),
                       (("dim", dim), ("start", start), ("end", end)),
                       n.shape[:-1] + (end - start,), n.dtype, n.source)
                  for part, (start, end) in enumerate(((0, cut), (cut, size)))]
        joined = Node(n.name, "concat", tuple(h.name for h in halves), (("dim", dim),), n.shape,
                      n.dtype, n.source)
        return [kept, *halves, joined]

    return [Change(node.name, f"split at {cut} of dim {dim} and rejoined", rejoined)]


def subtract_as_negated_add(node: Node, world: int) -> list[Change]:
    """`a - b` written as `a + (-b)` (numbers unchanged)."""
    if node.op != "sub":
        return []

    def negated_add(r: int, n: Node) -> Rewrite:
        left, right = n.inputs
        negated = Node(f"{n.name}.negated", "neg", (right,), (), n.shape, n.dtype, n.source)
        return [negated, replace(n, op="add", inputs=(left, negated.name))]

    return [Change(node.name, "a - b written as a + (-b)", negated_add)]


def reorder_reduce_group(node: Node, world: int) -> list[Change]:
    """An all_reduce over its group listed in reverse (a sum or max does not depend on the
    order; numbers unchanged)."""
    group = _group(node, world)
    if node.op != "all_reduce" or len(group) < 2:
        return []
    flipped = tuple(reversed(group))
    return [Change(node.name, f"reduce group listed as {list(flipped)}",
                   _same(_with(node, group=flipped)))]


OPERATORS: dict[str, Operator] = {
    "drop collective": drop_collective,
    "duplicate collective": duplicate_collective,
    "swap reduce op": swap_reduce_op,
    "change group": change_group,
    "shift slice": shift_slice,
    "scale constant": scale_constant,
    "reduction dim": change_reduction_dim,
    "permutation": change_permutation,
    "swap operands": swap_operands,
    "sibling op": replace_sibling,
    "commute operands": commute_operands,
    "transpose twice": transpose_twice,
    "split and rejoin": split_and_rejoin,
    "negated add": subtract_as_negated_add,
    "reorder reduce group": reorder_reduce_group,
}
# The operators above whose every change keeps the numbers: their mutants are equivalent.
NUMBER_PRESERVING = ("commute operands", "transpose twice", "split and rejoin", "negated add",
                     "reorder reduce group")
