"""Masks written another way are one mask.

PyTorch's attention (`scaled_dot_product_attention` lowered by its own decompositions) adds a
mask of zeros and -inf to the scores and takes a safe softmax, which gives zeros instead of NaN
on rows the mask covers whole. Code written by hand fills the scores with -inf where a boolean
mask says and takes a plain softmax. Two passes make the first the second:

- an additive mask (a constant of zeros and -inf, perhaps broadcast) is a fill of -inf where
  the constant is -inf, its boolean mask broadcast as the constant was;
- the safe softmax's test for rows masked whole is false where every row of the scores keeps a
  finite entry: scores computed from no infinite value but a mask's fill, by a constant mask
  that leaves each row an entry (checked on its value). Then each `where` choosing by that
  test is its third operand, and the softmax is a plain one, forward and backward.

A product with a boolean mask cast to numbers (vocab parallelism's `out * ~mask`) is a fill of
zeros too, and so is such a mask shifted to zero where it is on (`1 - mask.float()`,
`(~mask).float()`, `mask.float() - 1`: a constant filled where the mask is on). Values are taken as real numbers, as everywhere in the proof: only a
written -inf is infinite.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from .distributed import constant_values
from .graph import Graph, Node
from .ops import MOVEMENT, OPS, SOFTMAX

_BROADCASTS = frozenset({"expand", "unsqueeze"})
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


# A fill at or below this, read only by softmaxes, weighs exactly 0 after them in float32
# wherever the row's other scores lie within |fill| - 104 of its largest (exp underflows).
EXCLUDING_FILL = -1e4


def masks_as_fills(graph: Graph) -> Graph:
    """The graph with additive and multiplicative masks as fills, and safe softmaxes of finite
    rows plain."""
    return without_masked_row_guards(additive_masks_as_fills(product_masks_as_fills(graph)))


def excluding_fills(written: Graph, simplified: Graph) -> list[str]:
    """The source lines where `simplified` took a finite fill at or below EXCLUDING_FILL
    (Megatron's -10000, HuggingFace's dtype minimum, added or filled) of `written`'s softmax
    scores as -inf: a stated assumption of the proof (`additive_masks_as_fills`)."""
    lines = []
    for node in simplified:
        before = written[node.name] if node.name in written else None
        if node.op != "masked_fill" or node.attr("value") != -math.inf or before is None:
            continue
        test = f"{node.name}.mask"
        if (before.op == "masked_fill" and before.attr("value") != -math.inf
                or test in simplified and simplified[test].op == "le_scalar"):
            lines.append(str(before.source) if before.source else before.name)
    return list(dict.fromkeys(lines))


def product_masks_as_fills(graph: Graph) -> Graph:
    """Each product of a value and a boolean mask cast to numbers (`out * (~mask[..., None])`,
    `mask * (ids - start)`) as a fill of zeros where the mask is off, and each mask cast to
    numbers and shifted to zero where it is on (`1 - mask.float()`) as a constant filled with
    zeros there. The mask's negation cancels a negation it was built from, through broadcasts."""
    result = Graph()
    for node in graph:
        operands = _multiplied_mask(graph, node)
        if operands is not None:
            mask = _mask_under_broadcasts(graph, result, operands[1], node)
            value, off = operands[0], _negation(graph, result, mask, node)
        else:
            operands = _mask_complement(graph, result, node)
            if operands is None:
                result.add(node)
                continue
            value, off = operands
        zero = 0.0 if node.dtype.startswith(("float", "bfloat")) else 0
        result.add(Node(node.name, "masked_fill", (value, off), (("value", zero),), node.shape,
                        node.dtype, node.source))
    result.outputs = list(graph.outputs)
    return result.pruned() if len(result) != len(graph) else result


def _multiplied_mask(graph: Graph, node: Node) -> tuple[str, str] | None:
    """(the value, the boolean mask or its broadcasts) of a `mul` of a value and a cast boolean
    of its shape, the cast perhaps broadcast after it (torchtitan's `out * mask[..., None]
    .to(out.dtype)`: the cast before the broadcast to the lookup's rows)."""
    if node.op != "mul" or len(node.inputs) != 2:
        return None
    for factor_name, value in (node.inputs, node.inputs[::-1]):
        factor = graph[factor_name]
        while factor.op in _BROADCASTS:
            factor = graph[factor.inputs[0]]
        if (factor.op == "cast" and graph[factor.inputs[0]].dtype == "bool"
                and graph[factor_name].shape == graph[value].shape == node.shape):
            return value, factor_name
    return None


def _mask_under_broadcasts(graph: Graph, result: Graph, name: str, user: Node) -> str:
    """The boolean mask that `name` (a cast boolean, perhaps broadcast after the cast) casts:
    the broadcasts rebuilt on the boolean, in `result`."""
    node = graph[name]
    if node.op == "cast":
        return node.inputs[0]
    inner = _mask_under_broadcasts(graph, result, node.inputs[0], user)
    return result.add(replace(node, name=f"{user.name}.{node.name}", inputs=(inner,), dtype="bool",
                              source=user.source)).name


def _mask_complement(graph: Graph, result: Graph, node: Node) -> tuple[str, str] | None:
    """(a constant, the boolean mask) of a mask cast to numbers and shifted to zero where it is
    on: `1 - mask.float()` (Megatron), `mask.float() - 1` (DTensor's loss), `(~mask).float()`
    (nanotron). The constant (added to `result`) is its value where the mask is off."""
    if node.dtype not in _FLOATS:
        return None
    if node.op == "cast" and graph[node.inputs[0]].op in ("bitwise_not", "logical_not"):
        mask, off = graph[node.inputs[0]].inputs[0], 1.0
    elif node.op in ("rsub_scalar", "add_scalar") and graph[node.inputs[0]].op == "cast":
        mask, off = graph[node.inputs[0]].inputs[0], float(node.attr("value"))
        if off + (-1 if node.op == "rsub_scalar" else 1) != 0:
            return None
    else:
        return None
    if graph[mask].dtype != "bool":
        return None
    fill = result.add(Node(f"{node.name}.fill", "full", (), (("dtype", node.dtype),
                                                             ("shape", node.shape), ("value", off)),
                           node.shape, node.dtype, node.source))
    return fill.name, mask


def _negation(graph: Graph, result: Graph, name: str, user: Node) -> str:
    """A node of `result` that is the negation of boolean `name`: the operand of a negation,
    broadcasts of a negated operand, else a new `bitwise_not`."""
    node = result[name] if name in result else graph[name]
    if node.op in ("bitwise_not", "logical_not"):
        return node.inputs[0]
    if node.op in _BROADCASTS:
        inner = _negation(graph, result, node.inputs[0], user)
        return result.add(replace(node, name=f"{user.name}.{node.name}", inputs=(inner,),
                                  source=user.source)).name
    return result.add(Node(f"{user.name}.not", "bitwise_not", (name,), (), node.shape, "bool",
                           user.source)).name


def additive_masks_as_fills(graph: Graph) -> Graph:
    """Each `add` of a value and a constant of zeros and -inf as a `masked_fill` of -inf; and,
    where only softmaxes read the result and every row keeps an entry, each add of a constant
    of zeros and fills at or below EXCLUDING_FILL, and each such `masked_fill`, as one of -inf
    (`excluding_fills` names them: the report states the assumption). Not under a
    log_softmax, whose masked outputs are the fill itself."""
    values = constant_values(graph)
    users = graph.users()
    result = Graph()
    for node in graph:
        if node.op == "masked_fill" and _excluding_fill(graph, node, values, users):
            result.add(replace(node, attrs=(("value", -math.inf),)))
            continue
        operands = _masked_operand(graph, node, values)
        excluding = operands is None and _excluding_fill(graph, node, values, users)
        if excluding:
            operands = _large_negative_operand(graph, node, values)
        if operands is None:
            result.add(node)
            continue
        scores, mask = operands
        base, broadcasts = _broadcast_chain(graph, mask, values)
        test = ("le_scalar", EXCLUDING_FILL) if excluding else ("eq_scalar", -math.inf)
        fill = result.add(Node(f"{node.name}.mask", test[0], (base,), (("value", test[1]),),
                               graph[base].shape, "bool", node.source))
        for k, broadcast in enumerate(broadcasts):
            fill = result.add(replace(broadcast, name=f"{node.name}.mask{k}",
                                      inputs=(fill.name,), dtype="bool", source=node.source))
        result.add(Node(node.name, "masked_fill", (scores, fill.name), (("value", -math.inf),),
                        node.shape, node.dtype, node.source))
    result.outputs = list(graph.outputs)
    return result.pruned() if len(result) != len(graph) else result


def _masked_operand(graph: Graph, node: Node, values: dict) -> tuple[str, str] | None:
    """(the scores, the mask) of an add of a non-constant value and a constant of zeros and
    -inf of the add's shape, or None."""
    return _added_mask(graph, node, values, lambda value: value == -math.inf)


def _large_negative_operand(graph: Graph, node: Node, values: dict) -> tuple[str, str] | None:
    """(the scores, the mask) of an add of a non-constant value and a constant of zeros and
    finite values at or below EXCLUDING_FILL, some of them, of the add's shape; or None."""
    return _added_mask(graph, node, values,
                       lambda value: (value <= EXCLUDING_FILL) & value.isfinite())


def _added_mask(graph: Graph, node: Node, values: dict,
                masked: Callable[[torch.Tensor], torch.Tensor]) -> tuple[str, str] | None:
    """(the scores, the mask) of an add of a non-constant value and a constant of the add's
    shape whose elements are zeros or `masked`, some of them masked; or None."""
    if node.op != "add" or len(node.inputs) != 2:
        return None
    for mask, scores in (node.inputs, node.inputs[::-1]):
        value = values.get(mask)
        if (value is not None and scores not in values and value.is_floating_point()
                and graph[mask].shape == node.shape == graph[scores].shape
                and bool(((value == 0) | masked(value)).all()) and bool(masked(value).any())):
            return scores, mask
    return None


def _excluding_fill(graph: Graph, node: Node, values: dict,
                    users: dict[str, list[str]]) -> bool:
    """Whether `node` masks scores with a finite fill at or below EXCLUDING_FILL (a
    `masked_fill` by a constant mask, or an add of such a constant), read by softmaxes over
    its last dim alone (through casts), and every row along that dim keeps an entry: then a
    fill of -inf gives the same probabilities (in floating point)."""
    if node.op == "masked_fill":
        fill = node.attr("value")
        if (not isinstance(fill, float) or not math.isfinite(fill) or fill > EXCLUDING_FILL
                or values.get(node.inputs[1]) is None or node.inputs[0] in values):
            return False
        kept = ~torch.broadcast_to(values[node.inputs[1]].bool(), node.shape)
    else:
        operands = _large_negative_operand(graph, node, values)
        if operands is None:
            return False
        kept = values[operands[1]] > EXCLUDING_FILL
    if not node.shape or not bool(kept.any(-1).all()):
        return False
    return _read_by_softmaxes(graph, node.name, len(node.shape) - 1, users)


def _read_by_softmaxes(graph: Graph, name: str, dim: int, users: dict[str, list[str]]) -> bool:
    readers = users.get(name, [])
    if not readers or name in graph.outputs:
        return False
    for reader in map(graph.__getitem__, readers):
        if reader.op == "cast" and reader.dtype in _FLOATS:
            if not _read_by_softmaxes(graph, reader.name, dim, users):
                return False
        elif not (reader.op == "softmax" and reader.attr("dim") % len(reader.shape) == dim):
            return False
    return True


def _broadcast_chain(graph: Graph, name: str, values: dict) -> tuple[str, list[Node]]:
    """The constant `name` as broadcasts of an earlier constant: (that one, the broadcasts
    from it to `name`)."""
    chain: list[Node] = []
    node = graph[name]
    while node.op in _BROADCASTS and node.inputs[0] in values:
        chain.append(node)
        node = graph[node.inputs[0]]
    return node.name, chain[::-1]


def without_masked_row_guards(graph: Graph) -> Graph:
    """The graph with each `where` that chooses by a safe softmax's test for rows masked
    whole, where no row is, replaced by its third operand (its users read that instead)."""
    values = constant_values(graph)
    finite = _finite_values(graph)
    alias: dict[str, str] = {}
    result = Graph()
    for node in graph:
        node = replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        if node.op == "where" and _never_masked_whole(graph, node.inputs[0], values, finite):
            alias[node.name] = node.inputs[2]
            continue
        result.add(node)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result.pruned() if alias else result


def _finite_values(graph: Graph) -> set[str]:
    """The nodes computed from no written infinity (a softmax's probabilities are finite
    whatever its scores)."""
    finite: set[str] = set()
    for node in graph:
        written = [v for k, v in node.attrs if k in ("value", "values")]
        infinite = any(isinstance(v, float) and math.isinf(v) for v in written) or any(
            isinstance(v, tuple) and any(isinstance(x, float) and math.isinf(x) for x in v)
            for v in written)
        if OPS[node.op].trait == SOFTMAX or not infinite and all(i in finite for i in node.inputs):
            finite.add(node.name)
    return finite


def _never_masked_whole(graph: Graph, name: str, values: dict, finite: set[str]) -> bool:
    """Whether `name` is a safe softmax's test that a row of its scores is -inf throughout
    (not any(scores != -inf) along the softmax dim, perhaps broadcast), and no row is."""
    node = graph[name]
    while node.op == "expand":
        node = graph[node.inputs[0]]
    chain = []
    for op in ("logical_not", "ne_scalar", "sum", "cast", "logical_not", "eq_scalar"):
        if node.op != op or not node.inputs:
            return False
        chain.append(node)
        node = graph[node.inputs[0]]
    test, total, infinite = chain[1], chain[2], chain[5]
    if test.attr("value") != 0 or infinite.attr("value") != -math.inf:
        return False
    return _rows_keep_an_entry(graph, infinite.inputs[0], total.attr("dim"), values, finite)


def _rows_keep_an_entry(graph: Graph, name: str, dim: int, values: dict,
                        finite: set[str]) -> bool:
    """Whether every row of `name` along `dim` holds a finite value: it is finite, or a fill
    of -inf of a finite value by a constant mask that leaves each row an entry."""
    node = graph[name]
    while node.op in ("mul_scalar", "div_scalar") and node.attr("value") > 0 or node.op == "cast":
        node = graph[node.inputs[0]]
    if node.name in finite:
        return True
    if node.op != "masked_fill" or node.inputs[0] not in finite:
        return False
    mask = values.get(node.inputs[1])
    if mask is None:
        return False
    kept = ~torch.broadcast_to(mask.bool(), node.shape)
    return bool(kept.any(dim).all())
