"""The core op vocabulary: one table entry per op with its trait, shape rule and numeric meaning.

Frontends lower framework ops (aten, HLO) into these ops; rules, the verifier and the
interpreter read only this table. Adding an op is one row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .uninterpreted import APPLICATIONS

Shape = tuple[int, ...]
Attrs = dict[str, Any]

# Traits: how an op behaves under sharding; the rule templates expand over them.
UNARY, BINARY, WHERE, REDUCE, SOFTMAX, MATMUL = "unary", "binary", "where", "reduce", "softmax", "matmul"
MOVEMENT, EMBEDDING, OPAQUE, CONSTANT, PLACEHOLDER, COLLECTIVE = (
    "movement", "embedding", "opaque", "constant", "placeholder", "collective")
POINT_TO_POINT = "point_to_point"  # send/recv: linked across ranks when the graphs are merged
RANDOM = "random"  # a random draw: equal to no other value, not even another draw's


@dataclass(frozen=True)
class OpDef:
    """An op's trait (which rule templates apply), its output shape from input shapes, and its
    value on real tensors (for the interpreter and the rule tests)."""

    name: str
    trait: str
    shape: Callable[[list[Shape], Attrs], Shape]
    run: Callable[[list[torch.Tensor], Attrs], torch.Tensor]


def _same(shapes: list[Shape], attrs: Attrs) -> Shape:
    return shapes[0]


def _equal_shapes(shapes: list[Shape], attrs: Attrs) -> Shape:
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(f"elementwise operands must have equal shapes, got {shapes}")
    return shapes[0]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


_UNARY: dict[str, Callable[[torch.Tensor, Attrs], torch.Tensor]] = {
    "neg": lambda x, a: -x,
    "exp": lambda x, a: torch.exp(x),
    "log": lambda x, a: torch.log(x),
    "rsqrt": lambda x, a: torch.rsqrt(x),
    "sqrt": lambda x, a: torch.sqrt(x),
    "sin": lambda x, a: torch.sin(x),
    "cos": lambda x, a: torch.cos(x),
    "tanh": lambda x, a: torch.tanh(x),
    "sigmoid": lambda x, a: torch.sigmoid(x),
    "silu": lambda x, a: F.silu(x),
    "relu": lambda x, a: torch.relu(x),
    "gelu": lambda x, a: F.gelu(x, approximate=a.get("approximate", "none")),
    "erf": lambda x, a: torch.erf(x),
    "floor": lambda x, a: torch.floor(x),
    "ceil": lambda x, a: torch.ceil(x),
    "round": lambda x, a: torch.round(x),
    "trunc": lambda x, a: torch.trunc(x),
    "asin": lambda x, a: torch.asin(x),
    "acos": lambda x, a: torch.acos(x),
    "atan": lambda x, a: torch.atan(x),
    "reciprocal": lambda x, a: torch.reciprocal(x),
    "abs": lambda x, a: torch.abs(x),
    "logical_not": lambda x, a: torch.logical_not(x),
    "bitwise_not": lambda x, a: torch.bitwise_not(x),
    "cast": lambda x, a: x.to(_dtype(a["dtype"])),
    "add_scalar": lambda x, a: x + a["value"],
    "mul_scalar": lambda x, a: x * a["value"],
    "div_scalar": lambda x, a: x / a["value"],
    "rsub_scalar": lambda x, a: a["value"] - x,
    "pow_scalar": lambda x, a: torch.pow(x, a["value"]),
    "lt_scalar": lambda x, a: x < a["value"],
    "le_scalar": lambda x, a: x <= a["value"],
    "gt_scalar": lambda x, a: x > a["value"],
    "ge_scalar": lambda x, a: x >= a["value"],
    "eq_scalar": lambda x, a: x == a["value"],
    "ne_scalar": lambda x, a: x != a["value"],
}

_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor, Attrs], torch.Tensor]] = {
    "add": lambda x, y, a: x + y,
    "sub": lambda x, y, a: x - y,
    "mul": lambda x, y, a: x * y,
    "div": lambda x, y, a: x / y,
    "pow": lambda x, y, a: torch.pow(x, y),
    "maximum": lambda x, y, a: torch.maximum(x, y),
    "minimum": lambda x, y, a: torch.minimum(x, y),
    "logaddexp": lambda x, y, a: torch.logaddexp(x, y),
    "atan2": lambda x, y, a: torch.atan2(x, y),
    "fmod": lambda x, y, a: torch.fmod(x, y),
    "remainder": lambda x, y, a: torch.remainder(x, y),
    "eq": lambda x, y, a: x == y,
    "ne": lambda x, y, a: x != y,
    "lt": lambda x, y, a: x < y,
    "le": lambda x, y, a: x <= y,
    "gt": lambda x, y, a: x > y,
    "ge": lambda x, y, a: x >= y,
    "bitwise_and": lambda x, y, a: x & y,
    "bitwise_or": lambda x, y, a: x | y,
    "bitwise_xor": lambda x, y, a: x ^ y,
    "div_floor": lambda x, y, a: torch.div(x, y, rounding_mode="floor"),
    "div_trunc": lambda x, y, a: torch.div(x, y, rounding_mode="trunc"),
    "logical_and": lambda x, y, a: torch.logical_and(x, y),
    "logical_or": lambda x, y, a: torch.logical_or(x, y),
    "masked_fill": lambda x, mask, a: x.masked_fill(mask, a["value"]),
}


def _reduce_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    shape = list(shapes[0])
    shape[attrs["dim"]] = 1
    return tuple(shape)


def _matmul_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    (a, b) = shapes
    if len(a) != len(b) or len(a) < 2 or a[:-2] != b[:-2] or a[-1] != b[-2]:
        raise ValueError(f"matmul operands do not fit: {a} @ {b}")
    return a[:-1] + (b[-1],)


def _merge_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d = shapes[0], attrs["dim"]
    if s[d + 1] != attrs["inner"]:
        raise ValueError(f"merge inner size {attrs['inner']} does not match {s} at dim {d + 1}")
    return s[:d] + (s[d] * s[d + 1],) + s[d + 2:]


def _split_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d, inner = shapes[0], attrs["dim"], attrs["inner"]
    if inner <= 0 or s[d] % inner:
        raise ValueError(f"cannot split dim {d} of {s} by inner size {inner}")
    return s[:d] + (s[d] // inner, inner) + s[d + 1:]


def _unsqueeze_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d = shapes[0], attrs["dim"]
    return s[:d] + (1,) + s[d:]


def _squeeze_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d = shapes[0], attrs["dim"]
    if s[d] != 1:
        raise ValueError(f"cannot squeeze dim {d} of {s}")
    return s[:d] + s[d + 1:]


def _transpose_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s = list(shapes[0])
    d0, d1 = attrs["dim0"], attrs["dim1"]
    s[d0], s[d1] = s[d1], s[d0]
    return tuple(s)


def _expand_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d = list(shapes[0]), attrs["dim"]
    if s[d] != 1:
        raise ValueError(f"cannot expand dim {d} of {tuple(s)} (size is not 1)")
    s[d] = attrs["size"]
    return tuple(s)


def _slice_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d, start, end = list(shapes[0]), attrs["dim"], attrs["start"], attrs["end"]
    if not 0 <= start < end <= s[d]:
        raise ValueError(f"slice [{start}:{end}] out of range for dim {d} of {tuple(s)}")
    s[d] = end - start
    return tuple(s)


def _concat_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    d = attrs["dim"]
    first = shapes[0]
    if any(len(s) != len(first) or s[:d] + s[d + 1:] != first[:d] + first[d + 1:] for s in shapes):
        raise ValueError(f"concat operands do not fit along dim {d}: {shapes}")
    return first[:d] + (sum(s[d] for s in shapes),) + first[d + 1:]


def _embedding_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    weight, ids = shapes
    return ids + weight[1:]


def _pad_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    s, d = list(shapes[0]), attrs["dim"]
    s[d] += attrs["before"] + attrs["after"]
    return tuple(s)


def _pad(x: torch.Tensor, a: Attrs) -> torch.Tensor:
    widths = [0, 0] * (x.dim() - 1 - a["dim"]) + [a["before"], a["after"]]
    return F.pad(x, widths, value=a["value"])


def _take_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    source, index = shapes
    if source[:-1] != index:
        raise ValueError(f"take: index {index} must equal the source {source} without its last dim")
    return index


def _untake_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    values, index = shapes
    if values != index:
        raise ValueError(f"untake: values {values} and index {index} must have equal shapes")
    return values + (attrs["size"],)


def _embedding_grad_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    grad, ids = shapes
    if grad[:-1] != ids:
        raise ValueError(f"embedding_grad: gradient {grad} does not fit ids {ids}")
    return (attrs["rows"], grad[-1])


def _untake(values: torch.Tensor, index: torch.Tensor, a: Attrs) -> torch.Tensor:
    out = values.new_zeros(values.shape + (a["size"],))
    return out.scatter(-1, index.unsqueeze(-1), values.unsqueeze(-1))


def _embedding_grad(grad: torch.Tensor, ids: torch.Tensor, a: Attrs) -> torch.Tensor:
    out = grad.new_zeros((a["rows"], grad.shape[-1]))
    return out.index_add(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))


def _topk_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    return shapes[0][:-1] + (attrs["k"],)


def _attr_shape(shapes: list[Shape], attrs: Attrs) -> Shape:
    return tuple(attrs["shape"])


def _merge(x: torch.Tensor, a: Attrs) -> torch.Tensor:
    d = a["dim"]
    return x.reshape(x.shape[:d] + (x.shape[d] * x.shape[d + 1],) + x.shape[d + 2:])


def _split(x: torch.Tensor, a: Attrs) -> torch.Tensor:
    d, inner = a["dim"], a["inner"]
    return x.reshape(x.shape[:d] + (x.shape[d] // inner, inner) + x.shape[d + 1:])


def _expand(x: torch.Tensor, a: Attrs) -> torch.Tensor:
    shape = list(x.shape)
    shape[a["dim"]] = a["size"]
    return x.expand(shape)


def _iota(a: Attrs) -> torch.Tensor:
    values = torch.arange(a["start"], a["start"] + a["step"] * a["shape"][0], a["step"])
    return values.to(_dtype(a["dtype"]))


def _index(inputs: list[torch.Tensor], a: Attrs) -> torch.Tensor:
    source, indices = inputs[0], iter(inputs[1:])
    return source[tuple(slice(None) if is_none else next(indices) for is_none in a["none_positions"])]


def _collective(inputs: list[torch.Tensor], a: Attrs) -> torch.Tensor:
    raise RuntimeError("collectives are evaluated across ranks by the interpreter")


def _opaque(inputs: list[torch.Tensor], a: Attrs) -> torch.Tensor:
    raise NotImplementedError(f"{a['target']} has no lowering to the core IR")


OPS: dict[str, OpDef] = {}


def _register(op: OpDef) -> None:
    OPS[op.name] = op


for _name, _fn in _UNARY.items():
    _register(OpDef(_name, UNARY, _same, lambda xs, a, f=_fn: f(xs[0], a)))
for _name, _fn in _BINARY.items():
    _register(OpDef(_name, BINARY, _equal_shapes, lambda xs, a, f=_fn: f(xs[0], xs[1], a)))

for _op in [
    OpDef("placeholder", PLACEHOLDER, _attr_shape, _collective),
    OpDef("full", CONSTANT, _attr_shape,
          lambda xs, a: torch.full(a["shape"], a["value"], dtype=_dtype(a["dtype"]))),
    OpDef("iota", CONSTANT, _attr_shape, lambda xs, a: _iota(a)),
    OpDef("literal", CONSTANT, _attr_shape,
          lambda xs, a: torch.tensor(a["values"], dtype=_dtype(a["dtype"])).reshape(a["shape"])),
    OpDef("where", WHERE, _equal_shapes, lambda xs, a: torch.where(xs[0], xs[1], xs[2])),
    OpDef("sum", REDUCE, _reduce_shape, lambda xs, a: xs[0].sum(a["dim"], keepdim=True)),
    OpDef("amax", REDUCE, _reduce_shape, lambda xs, a: xs[0].amax(a["dim"], keepdim=True)),
    OpDef("logsumexp", REDUCE, _reduce_shape,
          lambda xs, a: torch.logsumexp(xs[0], a["dim"], keepdim=True)),
    OpDef("softmax", SOFTMAX, _same, lambda xs, a: torch.softmax(xs[0], a["dim"])),
    OpDef("log_softmax", SOFTMAX, _same, lambda xs, a: torch.log_softmax(xs[0], a["dim"])),
    OpDef("matmul", MATMUL, _matmul_shape, lambda xs, a: torch.matmul(xs[0], xs[1])),
    OpDef("merge", MOVEMENT, _merge_shape, lambda xs, a: _merge(xs[0], a)),
    OpDef("split", MOVEMENT, _split_shape, lambda xs, a: _split(xs[0], a)),
    OpDef("unsqueeze", MOVEMENT, _unsqueeze_shape, lambda xs, a: xs[0].unsqueeze(a["dim"])),
    OpDef("squeeze", MOVEMENT, _squeeze_shape, lambda xs, a: xs[0].squeeze(a["dim"])),
    OpDef("transpose", MOVEMENT, _transpose_shape,
          lambda xs, a: xs[0].transpose(a["dim0"], a["dim1"])),
    OpDef("expand", MOVEMENT, _expand_shape, lambda xs, a: _expand(xs[0], a)),
    OpDef("slice", MOVEMENT, _slice_shape,
          lambda xs, a: xs[0].narrow(a["dim"], a["start"], a["end"] - a["start"])),
    OpDef("concat", MOVEMENT, _concat_shape, lambda xs, a: torch.cat(xs, a["dim"])),
    # `before` and `after` elements of `value` around x along `dim` (the backward of a slice).
    OpDef("pad", MOVEMENT, _pad_shape, lambda xs, a: _pad(xs[0], a)),
    OpDef("embedding", EMBEDDING, _embedding_shape, lambda xs, a: F.embedding(xs[1], xs[0])),
    OpDef("index", OPAQUE, _attr_shape, _index),
    # take: out[..] = x[.., index[..]] (gather along the last dim); untake is its transpose.
    OpDef("take", OPAQUE, _take_shape,
          lambda xs, a: xs[0].gather(-1, xs[1].unsqueeze(-1)).squeeze(-1)),
    # topk / topk_index: the k largest values along the last dim (sorted) and their positions.
    OpDef("topk", OPAQUE, _topk_shape, lambda xs, a: torch.topk(xs[0], a["k"], dim=-1).values),
    OpDef("topk_index", OPAQUE, _topk_shape,
          lambda xs, a: torch.topk(xs[0], a["k"], dim=-1).indices),
    OpDef("untake", OPAQUE, _untake_shape, lambda xs, a: _untake(xs[0], xs[1], a)),
    # The gradient of an embedding table: rows[ids[..]] += grad[..], over `rows` rows.
    OpDef("embedding_grad", OPAQUE, _embedding_grad_shape,
          lambda xs, a: _embedding_grad(xs[0], xs[1], a)),
    # The product along `dim` (kept as size 1), as `sum`; no rules: an uninterpreted function.
    OpDef("prod", OPAQUE, _reduce_shape, lambda xs, a: xs[0].prod(a["dim"], keepdim=True)),
    # Fresh random draws of `shape` (a unique `draw` attribute keeps any two apart): uniform in
    # [0, 1), standard normal, a permutation of 0..n-1.
    OpDef("rand", RANDOM, _attr_shape,
          lambda xs, a: torch.rand(a["shape"], dtype=_dtype(a["dtype"]))),
    OpDef("randn", RANDOM, _attr_shape,
          lambda xs, a: torch.randn(a["shape"], dtype=_dtype(a["dtype"]))),
    OpDef("randperm", RANDOM, _attr_shape,
          lambda xs, a: torch.randperm(a["shape"][0], dtype=_dtype(a["dtype"]))),
    # Uninitialised memory (`torch.empty`): any value, drawn here as small random integers.
    OpDef("uninitialized", RANDOM, _attr_shape,
          lambda xs, a: torch.randint(-8, 8, a["shape"]).to(_dtype(a["dtype"]))),
    # An op with no lowering (`target` names it): only its output's shape and dtype are known.
    OpDef("opaque", OPAQUE, _attr_shape, _opaque),
    OpDef("all_reduce", COLLECTIVE, _same, _collective),
    OpDef("all_gather", COLLECTIVE, _attr_shape, _collective),
    OpDef("reduce_scatter", COLLECTIVE, _attr_shape, _collective),
    # all_to_all: rank r receives block r (`in_splits` rows) of every member's input, in order.
    OpDef("all_to_all", COLLECTIVE, _attr_shape, _collective),
    # send x to rank `peer`; recv a tensor of `shape` from rank `peer` (ir/distributed.py links them).
    OpDef("send", POINT_TO_POINT, _same, _collective),
    OpDef("recv", POINT_TO_POINT, _attr_shape, _collective),
]:
    _register(_op)
for _name, _application in APPLICATIONS.items():  # aten ops as uninterpreted functions
    _register(OpDef(_name, OPAQUE, _application.shape, _application.run))


# Ops no rewrite rule mentions: the prover knows only that equal inputs give equal values.
UNINTERPRETED = frozenset(APPLICATIONS) | {"prod", "index", "topk", "topk_index"}


def infer_shape(op: str, shapes: list[Shape], attrs: Attrs) -> Shape:
    """The output shape of `op`, or ValueError naming the mismatch."""
    return tuple(OPS[op].shape(shapes, attrs))

