"""Lowers aten and functional-collective ops (as seen at the dispatcher) into core IR ops."""
from __future__ import annotations

from math import prod

from typing import Any, Callable

import torch

from ..errors import CaptureError
from .builder import GraphBuilder, LogSoftmaxParts, Ref

Result = Ref | list[Ref] | tuple | None
Lowering = Callable[[GraphBuilder, str, list[Any], dict[str, Any], Any], Result]

LOWERINGS: dict[str, Lowering] = {}


def lowering(*names: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for name in names:
            LOWERINGS[name] = fn
        return fn
    return register


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _out_shape(out: Any) -> tuple[int, ...]:
    return tuple(out.shape)


# Prims (reached through torch's reference decompositions) that mean what the aten op of the
# same name means.
_PRIMS_AS_ATEN = {"add", "sub", "mul", "div", "neg", "exp", "log", "rsqrt", "sqrt", "sin", "cos",
                  "tanh", "abs", "reciprocal", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
                  "ge", "where", "bitwise_and", "bitwise_or", "bitwise_not", "erf", "pow", "cat",
                  "clone", "transpose", "permute", "slice", "squeeze", "view_of", "alias",
                  "sigmoid", "select", "floor", "ceil", "round", "trunc", "asin", "acos", "atan",
                  "atan2", "fmod", "remainder"}


def lowering_name(func: Any) -> tuple[str, bool]:
    """The LOWERINGS key of a dispatched op, and whether it writes its first argument in place
    (`add_` lowers as `add`; prims other than plain aten twins are keyed `prims.name`)."""
    name = func.overloadpacket.__name__
    if func.namespace == "prims":
        return (name if name in _PRIMS_AS_ATEN else f"prims.{name}"), False
    inplace = name.endswith("_") and not name.startswith("_")
    return (name.rstrip("_") if inplace else name), inplace


def opaque(b: GraphBuilder, target: str, inputs: list[Ref], out: Any, reason: str) -> Result:
    """An op with no lowering, kept as an `opaque` node per tensor output (shape and dtype
    only): the verifier reports what depends on it as unknown, and the numbers cannot run it."""
    def one(tensor: Any, index: int) -> Ref | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        return b.emit("opaque", inputs, _dtype_name(tensor.dtype), shape=tuple(tensor.shape),
                      target=target, output=index, reason=reason)
    if isinstance(out, (tuple, list)):
        return [one(tensor, index) for index, tensor in enumerate(out)]
    return one(out, 0)


# Identity and aliasing: no node, the result is the input.
@lowering("clone", "alias", "contiguous", "detach", "lift_fresh", "_wrap_tensor_autograd",
          "wait_tensor", "lift_fresh_copy", "conj_physical", "conj", "resolve_conj", "view_of",
          "positive", "_conj", "resolve_neg")
def _identity(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return args[0]


@lowering("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size")
def _no_value(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return None


@lowering("_to_copy", "to", "prims.convert_element_type", "type_as")
def _to_copy(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return _cast_to(b, args[0], out)


# Constants.
@lowering("ones", "zeros", "full", "scalar_tensor", "new_ones", "new_zeros", "new_full",
          "zeros_like", "ones_like", "full_like")
def _full(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    value = {"ones": 1, "new_ones": 1, "ones_like": 1, "zeros": 0, "new_zeros": 0, "zeros_like": 0}
    fill = value.get(name)
    if fill is None:
        fill = args[0] if name == "scalar_tensor" else args[-1]
    return b.emit("full", [], _dtype_name(out.dtype), shape=_out_shape(out), value=_scalar(fill),
                  dtype=_dtype_name(out.dtype))


@lowering("arange")
def _arange(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    numbers = [a for a in args if isinstance(a, (int, float))]
    start, step = (numbers[0], numbers[2] if len(numbers) > 2 else 1) if len(numbers) > 1 else (0, 1)
    return b.emit("iota", [], _dtype_name(out.dtype), shape=_out_shape(out), start=start, step=step,
                  dtype=_dtype_name(out.dtype))


def _scalar(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    raise CaptureError(f"unsupported scalar argument {value!r}")


# Elementwise ops.
_SCALAR_FORMS = {"add": "add_scalar", "mul": "mul_scalar", "div": "div_scalar", "pow": "pow_scalar",
                 "lt": "lt_scalar", "le": "le_scalar", "gt": "gt_scalar", "ge": "ge_scalar",
                 "eq": "eq_scalar", "ne": "ne_scalar"}
_UNARY_NAMES = ["neg", "exp", "log", "rsqrt", "sqrt", "sin", "cos", "tanh", "sigmoid", "silu",
                "relu", "reciprocal", "abs", "logical_not", "bitwise_not", "gelu", "erf", "floor",
                "ceil", "round", "trunc", "asin", "acos", "atan"]


_PROMOTING = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "logaddexp", "atan2",
              "fmod", "remainder", "div_floor", "div_trunc"}


def _elementwise(b: GraphBuilder, op: str, operands: list[Any], out: Any, **attrs: Any) -> Ref:
    """`op` on broadcast operands; arithmetic casts its operands to the result type first (type
    promotion made explicit)."""
    shape, dtype = _out_shape(out), _dtype_name(out.dtype)
    refs = [b.broadcast(o, shape) for o in operands]
    if op in _PROMOTING:
        refs = [r if r.dtype == dtype else b.emit("cast", [r], dtype, dtype=dtype) for r in refs]
    return b.emit(op, refs, dtype, **attrs)


def _cast_to(b: GraphBuilder, ref: Ref, out: Any) -> Ref:
    dtype = _dtype_name(out.dtype)
    return ref if ref.dtype == dtype else b.emit("cast", [ref], dtype, dtype=dtype)


@lowering(*_UNARY_NAMES)
def _unary(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    attrs = {"approximate": kwargs.get("approximate", "none")} if name == "gelu" else {}
    return _elementwise(b, name, [args[0]], out, **attrs)


@lowering("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
          "ge", "bitwise_and", "bitwise_or", "logical_and", "logical_or", "rsub", "logaddexp",
          "atan2", "fmod", "remainder")
def _binary(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, y = args[0], args[1]
    mode = kwargs.get("rounding_mode")
    if mode is not None and not out.dtype.is_floating_point:  # exact integer division
        dtype = _dtype_name(out.dtype)
        return _elementwise(b, f"div_{mode}", [_as_tensor(b, v, dtype) for v in (x, y)], out)
    if mode is not None:  # a float quotient rounded towards zero or down
        quotient = _binary(b, name, [x, y], {}, out)
        return b.emit("trunc" if mode == "trunc" else "floor", [quotient])
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if name == "rsub":
        x, y, name = y, x, "sub"
    if alpha != 1:
        y = _elementwise(b, "mul_scalar", [y], out, value=alpha) if isinstance(y, Ref) else y * alpha
    if name == "sub" and not isinstance(y, Ref):
        name, y = "add", -y
    if isinstance(x, Ref) and isinstance(y, Ref):
        return _elementwise(b, name, [x, y], out)
    if isinstance(x, Ref) and name in _SCALAR_FORMS:
        return _elementwise(b, _SCALAR_FORMS[name], [x], out, value=_scalar(y))
    if isinstance(y, Ref) and name in ("add", "mul"):
        return _elementwise(b, f"{name}_scalar", [y], out, value=_scalar(x))
    if isinstance(y, Ref) and name == "sub":
        return _elementwise(b, "rsub_scalar", [y], out, value=_scalar(x))
    # The scalar as a 0-dim tensor (`2 ** x`): of the result's type if arithmetic promotes it.
    dtype = _dtype_name(out.dtype) if name in _PROMOTING else (x if isinstance(x, Ref) else y).dtype
    return _elementwise(b, name, [_as_tensor(b, x, dtype), _as_tensor(b, y, dtype)], out)


@lowering("__or__", "__and__")
def _python_bitwise(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """`a | b` and `a & b` on tensors (DTensor's vocab masks use them)."""
    return _binary(b, "bitwise_or" if name == "__or__" else "bitwise_and", args, kwargs, out)


@lowering("where")
def _where(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A choice with a Python number on one side is a fill of the other side (where the
    condition fails, for a number taken where it holds: its complement), as `masked_fill`
    and PyTorch's own losses write it."""
    cond, x, y = args
    shape, dtype = _out_shape(out), _dtype_name(out.dtype)
    numbers = [_number(b, v) for v in (x, y)]
    if (numbers[0] is None) != (numbers[1] is None):
        kept, number = (y, numbers[0]) if numbers[1] is None else (x, numbers[1])
        mask = b.broadcast(cond if kept is y else complement(b, cond), shape)
        return filled(b, b.broadcast(_cast_to(b, kept, out), shape), mask, number)
    operands = [_as_tensor(b, v, dtype) for v in (x, y)]
    refs = [b.broadcast(o, shape) for o in [cond, *operands]]
    return b.emit("where", refs, dtype)


# A comparison with a number and the comparison that holds exactly where it fails (on real
# numbers, as everywhere in the proof).
_COMPLEMENTS = {"eq_scalar": "ne_scalar", "ne_scalar": "eq_scalar", "lt_scalar": "ge_scalar",
                "ge_scalar": "lt_scalar", "gt_scalar": "le_scalar", "le_scalar": "gt_scalar"}


def complement(b: GraphBuilder, mask: Ref) -> Ref:
    """The boolean that holds where `mask` fails: the complementary comparison of a comparison
    with a number, the operand of a negation, either under the same broadcasts, else a
    `bitwise_not`."""
    node = b.graph[mask.name]
    if node.op in ("unsqueeze", "expand"):
        inner = complement(b, Ref(node.inputs[0], *_shape_dtype(b, node.inputs[0])))
        return b.emit(node.op, [inner], "bool", **dict(node.attrs))
    if node.op in _COMPLEMENTS:
        return b.emit(_COMPLEMENTS[node.op], [Ref(node.inputs[0], *_shape_dtype(b, node.inputs[0]))],
                      "bool", value=node.attr("value"))
    if node.op in ("bitwise_not", "logical_not"):
        return Ref(node.inputs[0], *_shape_dtype(b, node.inputs[0]))
    return b.emit("bitwise_not", [mask], "bool")


def _number(b: GraphBuilder, value: Any) -> Any:
    """`value` as a Python number when it is one or a 0-dim constant (a number the call
    wrapped as a tensor); else None."""
    if not isinstance(value, Ref):
        return value
    node = b.graph[value.name]
    return node.attr("value") if node.op == "full" and node.shape == () else None


def _shape_dtype(b: GraphBuilder, name: str) -> tuple[tuple[int, ...], str]:
    node = b.graph[name]
    return node.shape, node.dtype


def _as_tensor(b: GraphBuilder, value: Any, dtype: str) -> Ref:
    if isinstance(value, Ref):
        return value
    return b.emit("full", [], dtype, shape=(), value=_scalar(value), dtype=dtype)


@lowering("masked_fill")
def _masked_fill(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, mask, value = args
    if isinstance(value, Ref):  # a 0-dim tensor value: where(mask, value, x)
        return _where(b, "where", [mask, value, x], {}, out)
    shape = _out_shape(out)
    return filled(b, b.broadcast(x, shape), b.broadcast(mask, shape), value)


def filled(b: GraphBuilder, x: Ref, mask: Ref, value: Any) -> Ref:
    """x with `value` where `mask` holds (same shapes), the value spelled one way per dtype:
    0 and 0.0 fill a float alike."""
    value = _scalar(value)
    if x.dtype.startswith(("float", "bfloat")):
        value = float(value)
    return b.emit("masked_fill", [x, mask], value=value)


# Reductions and normalisations.
def _reduce(b: GraphBuilder, op: str, x: Ref, dims: list[int], keepdim: bool) -> Ref:
    """`op` over `dims` (every dim if empty). Adjacent dims are merged and reduced once, so a
    sum over a whole `[b, s]` tensor is the sum over its flattened `[b * s]` view, as code that
    flattens first writes it."""
    dims = sorted({_dim(d, len(x.shape)) for d in dims} if dims else range(len(x.shape)))
    if len(dims) > 1 and dims == list(range(dims[0], dims[-1] + 1)):
        shape, first, last = tuple(x.shape), dims[0], dims[-1] + 1
        reduced = b.emit(op, [b.reshape(x, shape[:first] + (prod(shape[first:last]),) + shape[last:])],
                         dim=first)
        if keepdim:
            return b.reshape(reduced, tuple(1 if d in dims else n for d, n in enumerate(shape)))
        return b.emit("squeeze", [reduced], dim=first)
    for dim in dims:
        x = b.emit(op, [x], dim=dim)
    if not keepdim:
        for dim in reversed(dims):
            x = b.emit("squeeze", [x], dim=dim)
    return x


@lowering("sum", "mean", "amax", "logsumexp")
def _sum(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    dims = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("dim") or []
    if isinstance(dims, int):
        dims = [dims]
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    op = "sum" if name == "mean" else name
    if op == "sum" and x.dtype == "bool":  # a count: summed as integers
        x = b.emit("cast", [x], "int64", dtype="int64")
    result = _reduce(b, op, x, list(dims), keepdim)
    if name == "mean":
        count = 1
        for dim in (dims or range(len(x.shape))):
            count *= x.shape[_dim(dim, len(x.shape))]
        result = b.emit("mul_scalar", [result], value=1.0 / count)
    return _cast_to(b, result, out)


@lowering("_softmax")
def _softmax(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, dim = args[0], _dim(args[1], len(args[0].shape))
    return _cast_to(b, b.emit("softmax", [x], dim=dim), out)


@lowering("_log_softmax")
def _log_softmax(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """x - max - log(sum(exp(x - max))), spelled out: a vocab-parallel loss computes the same
    pieces across ranks (a max, a sum of exponentials, the target's shifted logit) without
    ever forming the log-probabilities."""
    x, dim = args[0], _dim(args[1], len(args[0].shape))
    shifted = b.emit("sub", [x, b.broadcast(b.emit("amax", [x], dim=dim), x.shape)])
    total = b.emit("squeeze", [b.emit("sum", [b.emit("exp", [shifted])], dim=dim)], dim=dim)
    log_sum_exp = b.emit("log", [total])
    result = b.emit("sub", [shifted, b.broadcast(b.emit("unsqueeze", [log_sum_exp], dim=dim),
                                                 x.shape)])
    result = _cast_to(b, result, out)
    b.log_softmax_parts[result.name] = LogSoftmaxParts(dim, shifted, total, log_sum_exp)
    return result


@lowering("_log_softmax_backward_data")
def _log_softmax_backward(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """grad - softmax * sum(grad), the softmax as exp(shifted) / sum(exp(shifted)) from the
    forward's pieces (as a vocab-parallel loss's ranks compute it), else exp(output)."""
    grad, output = args[0], args[1]
    dim = _dim(args[2], len(output.shape))
    parts = b.log_softmax_parts.get(output.name)
    if parts is not None and parts.dim == dim:
        total = b.broadcast(b.emit("unsqueeze", [parts.total], dim=dim), output.shape)
        probs = b.emit("div", [b.emit("exp", [parts.shifted]), total])
    else:
        probs = b.emit("exp", [output])
    picked = b.graph[grad.name]
    if picked.op == "untake" and dim == len(grad.shape) - 1:  # one class per row: its value
        summed = b.emit("unsqueeze", [Ref(picked.inputs[0], grad.shape[:-1], grad.dtype)], dim=dim)
    else:
        summed = b.emit("sum", [grad], dim=dim)
    summed = b.broadcast(summed, grad.shape)
    return _cast_to(b, b.emit("sub", [grad, b.emit("mul", [probs, summed])]), out)


@lowering("native_layer_norm")
def _layer_norm(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, normalized_shape, weight, bias, eps = args
    dims = list(range(len(x.shape) - len(normalized_shape), len(x.shape)))
    n = 1
    for size in normalized_shape:
        n *= size
    mean = b.emit("mul_scalar", [_reduce(b, "sum", x, dims, True)], value=1.0 / n)
    centered = b.emit("sub", [x, b.broadcast(mean, x.shape)])
    squared = b.emit("mul", [centered, centered])
    variance = b.emit("mul_scalar", [_reduce(b, "sum", squared, dims, True)], value=1.0 / n)
    rstd = b.emit("rsqrt", [b.emit("add_scalar", [variance], value=eps)])
    result = b.emit("mul", [centered, b.broadcast(rstd, x.shape)])
    if weight is not None:
        result = b.emit("mul", [result, b.broadcast(weight, x.shape)])
    if bias is not None:
        result = b.emit("add", [result, b.broadcast(bias, x.shape)])
    return (result, mean, rstd)


# Matrix products.
@lowering("mm", "bmm")
def _mm(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.emit("matmul", [args[0], args[1]])


@lowering("addmm")
def _addmm(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    bias, x, w = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    product = b.emit("matmul", [x, w])
    if alpha != 1:
        product = b.emit("mul_scalar", [product], value=_scalar(alpha))
    if beta == 0:
        return product
    bias = b.broadcast(bias, product.shape)
    if beta != 1:
        bias = b.emit("mul_scalar", [bias], value=_scalar(beta))
    return b.emit("add", [product, bias])


# Movement.
@lowering("view", "_unsafe_view", "reshape")
def _view(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.reshape(args[0], _out_shape(out))


@lowering("unsqueeze")
def _unsqueeze(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.emit("unsqueeze", [args[0]], dim=_dim(args[1], len(args[0].shape) + 1))


@lowering("squeeze")
def _squeeze(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.reshape(args[0], _out_shape(out))


@lowering("expand")
def _expand(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.broadcast(args[0], _out_shape(out))


@lowering("t")
def _t(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return args[0] if len(args[0].shape) < 2 else b.emit("transpose", [args[0]], dim0=0, dim1=1)


@lowering("transpose")
def _transpose(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    d0, d1 = sorted((_dim(args[1], len(x.shape)), _dim(args[2], len(x.shape))))
    return x if d0 == d1 else b.emit("transpose", [x], dim0=d0, dim1=d1)


@lowering("permute")
def _permute(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    return b.permute(x, [_dim(d, len(x.shape)) for d in args[1]])


@lowering("slice")
def _slice(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    dim = _dim(args[1] if len(args) > 1 else 0, len(x.shape))
    size = x.shape[dim]
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else size
    step = args[4] if len(args) > 4 else 1
    start, end = max(0, min(_dim(start, size), size)), max(0, min(_dim(end, size), size))
    if end <= start:  # an empty part (the pass-through of a rotary embedding over all dims)
        return b.emit("full", [], x.dtype, shape=_out_shape(out), value=0, dtype=x.dtype)
    if step != 1:
        return _strided(b, x, dim, start, len(range(start, end, step)), step)
    return _cut(b, x, dim, start, end)


def _strided(b: GraphBuilder, x: Ref, dim: int, start: int, count: int, step: int) -> Ref:
    """Every `step`-th element of `x` along `dim` from `start`, `count` of them: the run they
    span cut into rows of `step`, the first column of each. A last element with no full row
    after it is sliced on its own."""
    if count == 0:
        raise CaptureError("aten.slice with a step that selects no element is not supported")
    whole = count if start + count * step <= x.shape[dim] else count - 1
    parts = []
    if whole:
        run = _cut(b, x, dim, start, start + whole * step)
        rows = b.emit("split", [run], dim=dim, inner=step)
        first = b.emit("slice", [rows], dim=dim + 1, start=0, end=1)
        parts.append(b.emit("squeeze", [first], dim=dim + 1))
    if whole < count:
        last = start + whole * step
        parts.append(b.emit("slice", [x], dim=dim, start=last, end=last + 1))
    return b.concat(parts, dim) if len(parts) > 1 else parts[0]


def _cut(b: GraphBuilder, x: Ref, dim: int, start: int, end: int) -> Ref:
    """Elements `start:end` of `x` along `dim` (`x` itself when that is all of it)."""
    whole = (start, end) == (0, x.shape[dim])
    return x if whole else b.emit("slice", [x], dim=dim, start=start, end=end)


@lowering("select")
def _select(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, dim = args[0], _dim(args[1], len(args[0].shape))
    index = _dim(args[2], x.shape[dim])
    piece = b.emit("slice", [x], dim=dim, start=index, end=index + 1) if x.shape[dim] > 1 else x
    return b.emit("squeeze", [piece], dim=dim)


@lowering("cat")
def _cat(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    tensors = [t for t in args[0] if t.shape != (0,)]
    dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), len(tensors[0].shape))
    parts = [t for t in tensors if t.shape[dim]] or tensors[:1]  # empty parts add nothing
    return b.concat(parts, dim)


@lowering("split", "split_with_sizes")
def _split(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), len(x.shape))
    pieces, start = [], 0
    for piece in out:
        end = start + piece.shape[dim]
        pieces.append(_cut(b, x, dim, start, end))
        start = end
    return pieces


@lowering("unbind")
def _unbind(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    dim = _dim(args[1] if len(args) > 1 else 0, len(x.shape))
    return [_select(b, "select", [x, dim, index], {}, None) for index in range(x.shape[dim])]


@lowering("embedding")
def _embedding(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.emit("embedding", [args[0], args[1]])


@lowering("index")
def _index(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    source, indices = args
    tensors = [i for i in indices if i is not None]
    moved = _index_by_aranges(b, source, indices, _out_shape(out))
    if moved is not None:
        return moved
    if _one_per_row(b, source, indices):
        return b.emit("take", [source, indices[-1]])
    return b.emit("index", [source, *tensors], _dtype_name(out.dtype), shape=_out_shape(out),
                  none_positions=tuple(i is None for i in indices))


def _arange_dim(b: GraphBuilder, ref: Ref) -> int | None:
    """The one dim along which index tensor `ref` counts 0, 1, 2, ... (an arange broadcast into
    place), or None."""
    node, unsqueezed = b.graph[ref.name], []
    while node.op in ("unsqueeze", "expand") or (node.op == "add_scalar" and node.attr("value") == 0):
        if node.op == "unsqueeze":
            unsqueezed.append(node.attr("dim"))
        node = b.graph[node.inputs[0]]
    if node.op != "iota" or node.attr("start") != 0 or node.attr("step") != 1:
        return None
    position = 0
    for dim in reversed(unsqueezed):  # replay the unsqueezes from the arange outward
        position += dim <= position
    return position if ref.shape[position] in (1, node.shape[0]) else None


def _one_per_row(b: GraphBuilder, source: Ref, indices: list) -> bool:
    """`source[arange_0, ..., ids]`: the leading indices count along the rows and `ids` picks one
    position along the last dim of each row (a gather; `logits[arange(n), target]`). Ids are
    taken to be in range, not negative: as for a gather, the `take` they become."""
    rows = source.shape[:-1]
    return (len(indices) == len(source.shape) > 1 and all(i is not None for i in indices)
            and indices[-1].shape == rows and _arange_dim(b, indices[-1]) is None
            and [_arange_dim(b, i) for i in indices[:-1]] == list(range(len(rows)))
            and all(i.shape == rows for i in indices[:-1]))


def _index_by_aranges(b: GraphBuilder, source: Ref, indices: list, shape: tuple[int, ...]) -> Ref | None:
    """`source[arange_0, arange_1, ...]` with each arange counting along its own output dim (how
    masks are built) is data movement: unsqueezes around the source's dims, in order."""
    if any(i is None for i in indices) or len(indices) != len(source.shape):
        return None
    dims = [_arange_dim(b, i) for i in indices]
    if None in dims or dims != sorted(dims) or len(set(dims)) != len(dims) or any(
            shape[d] != source.shape[k] for k, d in enumerate(dims)):
        return None
    for position in range(len(shape)):
        if position not in dims:
            source = b.emit("unsqueeze", [source], dim=position)
    return source


# Backward-only ops without a decomposition into core ops (see tracer.DECOMPOSED for the rest).
def _pad(b: GraphBuilder, x: Ref, dim: int, before: int, after: int, value: Any = 0.0) -> Ref:
    """`x` with `before` and `after` elements of `value` around it along `dim`."""
    if not before and not after:
        return x
    return b.emit("pad", [x], dim=dim, before=before, after=after, value=_scalar(value))


@lowering("slice_backward")
def _slice_backward(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    grad, sizes, dim, start, end, step = args
    dim = _dim(dim, len(sizes))
    start, end = max(0, min(_dim(start, sizes[dim]), sizes[dim])), min(end, sizes[dim])
    if step != 1:  # each element at the head of a row of `step`, the rows laid end to end
        count = grad.shape[dim]
        rows = _pad(b, b.emit("unsqueeze", [grad], dim=dim + 1), dim + 1, 0, step - 1)
        run = _cut(b, b.emit("merge", [rows], dim=dim, inner=step), dim, 0,
                   min(count * step, sizes[dim] - start))
        return _pad(b, run, dim, start, sizes[dim] - start - run.shape[dim])
    return _pad(b, grad, dim, start, sizes[dim] - end)


@lowering("select_backward")
def _select_backward(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    grad, sizes, dim, index = args
    dim = _dim(dim, len(sizes))
    index = _dim(index, sizes[dim])
    return _pad(b, b.emit("unsqueeze", [grad], dim=dim), dim, index, sizes[dim] - index - 1)


@lowering("constant_pad_nd")
def _constant_pad(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, pad = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    for position in range(0, len(pad), 2):
        before, after = pad[position], pad[position + 1]
        if before < 0 or after < 0:
            raise CaptureError("aten.constant_pad_nd with negative padding is not supported")
        x = _pad(b, x, len(x.shape) - 1 - position // 2, before, after, value)
    return x


@lowering("topk")
def _topk(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, k = args[0], args[1]
    dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", -1), len(x.shape))
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    ordered = args[4] if len(args) > 4 else kwargs.get("sorted", True)
    if dim != len(x.shape) - 1 or not largest or not ordered:
        raise CaptureError("aten.topk is supported for the largest values along the last dim, sorted")
    return b.emit("topk", [x], k=k), b.emit("topk_index", [x], "int64", k=k)


def _ignored(b: GraphBuilder, target: Ref, ignore_index: int) -> tuple[Ref, Ref]:
    """(mask of ignored targets, targets with the ignored ones set to 0)."""
    ignored = b.emit("eq_scalar", [target], "bool", value=ignore_index)
    return ignored, b.emit("masked_fill", [target, ignored], value=0)


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@lowering("nll_loss_forward")
def _nll_loss(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    logp, target, weight, reduction, ignore_index = args
    if weight is not None or len(logp.shape) != 2:
        raise CaptureError("aten.nll_loss_forward is supported on [tokens, classes] without weights")
    ignored, safe = _ignored(b, target, ignore_index)
    parts = b.log_softmax_parts.get(logp.name)
    if parts is None or parts.dim != len(logp.shape) - 1:
        losses = b.emit("neg", [b.emit("masked_fill", [b.emit("take", [logp, safe]), ignored],
                                       value=0.0)])
    else:  # -log p[t] = log-sum-exp - shifted[t], without the log-probabilities
        shifted, log_sum_exp = parts.shifted, parts.log_sum_exp
        losses = b.emit("sub", [log_sum_exp, b.emit("take", [shifted, safe])])
        losses = b.emit("masked_fill", [losses, ignored], value=0.0)
    counted = b.emit("cast", [b.emit("ne_scalar", [target], "bool", value=ignore_index)], "int64",
                     dtype="int64")
    count = b.emit("squeeze", [b.emit("sum", [counted], dim=0)], dim=0)
    total = b.emit("cast", [count], logp.dtype, dtype=logp.dtype)
    if _REDUCTIONS[reduction] == "none":
        return (losses, total)
    loss = b.emit("squeeze", [b.emit("sum", [losses], dim=0)], dim=0)
    if _REDUCTIONS[reduction] == "mean":
        loss = b.emit("div", [loss, total])
    return (loss, total)


@lowering("nll_loss_backward")
def _nll_loss_backward(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    grad, logp, target, weight, reduction, ignore_index, total = args
    if weight is not None or len(logp.shape) != 2:
        raise CaptureError("aten.nll_loss_backward is supported on [tokens, classes] without weights")
    if _REDUCTIONS[reduction] == "mean":
        grad = b.emit("div", [grad, total])
    if _REDUCTIONS[reduction] != "none":
        grad = b.broadcast(grad, target.shape)
    ignored, safe = _ignored(b, target, ignore_index)
    grad = b.emit("neg", [b.emit("masked_fill", [grad, ignored], value=0.0)])
    return b.emit("untake", [grad, safe], size=logp.shape[-1])


@lowering("embedding_dense_backward")
def _embedding_backward(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """The tokens' gradients summed into the rows of their ids; tokens at `padding_idx` (-1:
    none) add nothing, and with `scale_grad_by_freq` each is first divided by how many tokens
    share its id."""
    grad, ids, rows, padding_idx, scale_by_frequency = args
    if scale_by_frequency:
        ones = b.emit("full", [], grad.dtype, shape=ids.shape + (1,), value=1.0, dtype=grad.dtype)
        counts = b.emit("embedding", [b.emit("embedding_grad", [ones, ids], rows=rows), ids])
        grad = b.emit("div", [grad, b.broadcast(counts, grad.shape)])
    if padding_idx is not None and padding_idx >= 0:
        padding = b.emit("eq_scalar", [ids], "bool", value=padding_idx)
        padding = b.broadcast(b.emit("unsqueeze", [padding], dim=len(ids.shape)), grad.shape)
        grad = b.emit("masked_fill", [grad, padding], value=0.0)
    return b.emit("embedding_grad", [grad, ids], rows=rows)


# Functional collectives (torch.distributed._functional_collectives), group resolved to ranks.
@lowering("all_reduce")
def _all_reduce(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.emit("all_reduce", [args[0]], reduce=args[1], group=args[2])


@lowering("all_gather_into_tensor")
def _all_gather(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.emit("all_gather", [args[0]], shape=_out_shape(out), group=args[2])


@lowering("reduce_scatter_tensor")
def _reduce_scatter(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    source, dim = _scattered_along(b, args[0], len(args[3]))
    attrs = {"dim": dim} if dim else {}
    return b.emit("reduce_scatter", [source], shape=_out_shape(out), reduce=args[1],
                  group=args[3], **attrs)


@lowering("all_to_all_single")
def _all_to_all(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    source, input_splits, group = args[0], args[2], args[3]
    rows, world = source.shape[0], len(group)
    in_splits = tuple(input_splits) if input_splits else (rows // world,) * world
    return b.emit("all_to_all", [source], shape=_out_shape(out), in_splits=in_splits, group=group)
# Point-to-point (c10d.send / c10d.recv_ on a list of one tensor): `peer` is a rank of the
# default group (sub-group peers are not resolved).
@lowering("send")
def _send(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    (tensor,), _, peer, tag = args
    return b.emit("send", [tensor], peer=peer, tag=tag)


@lowering("recv")
def _recv(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    (buffer,), _, peer, tag = args
    return b.emit("recv", [], buffer.dtype, shape=buffer.shape, peer=peer, tag=tag)


def _scattered_along(b: GraphBuilder, ref: Ref, world: int) -> tuple[Ref, int]:
    """`(x, e)` when `ref` stacks the `world` equal blocks of x along dim e on dim 0 (how
    functional collectives reduce-scatter along e), else `(ref, 0)`."""
    pieces, stack = [], [ref.name]
    while stack:
        node = b.graph[stack.pop()]
        if node.op == "concat" and node.attr("dim") == 0 and len(pieces) < world:
            stack.extend(reversed(node.inputs))
        else:
            pieces.append(node)
    if len(pieces) != world or any(p.op != "slice" or p.inputs != pieces[0].inputs for p in pieces):
        return ref, 0
    dim = pieces[0].attr("dim")
    rows = pieces[0].shape[dim]
    if [(p.attr("dim"), p.attr("start"), p.attr("end")) for p in pieces] != \
            [(dim, k * rows, (k + 1) * rows) for k in range(world)]:
        return ref, 0
    source = b.graph[pieces[0].inputs[0]]
    return Ref(source.name, source.shape, source.dtype), dim


def lower(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Lower one dispatcher call; an op without a lowering (or a variant its lowering does not
    cover) is a CaptureError naming it."""
    fn = LOWERINGS.get(name)
    if fn is None:
        raise CaptureError(f"unsupported op aten.{name} (no lowering to the core IR)")
    return fn(b, name, args, kwargs, out)


# Register the lowerings of the modules below (spelled with several ops; gathers and scatters;
# random draws and data-dependent shapes; aten ops kept as uninterpreted functions; writes
# into views).
from . import composites, draws, indexing, uninterpreted, view_writes  # noqa: E402,F401
