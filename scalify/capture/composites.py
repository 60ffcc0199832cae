"""Lowerings of aten ops the core IR spells with several of its ops: reductions with indices,
`mv`, `roll`, `as_strided` views, uninitialised buffers and writes into them, and the prims
torch's reference decompositions bottom out in."""
from __future__ import annotations

import uuid
from typing import Any

import torch

from ..errors import CaptureError
from .aten import (Result, _binary, _cast_to, _dim, _dtype_name, _out_shape, _reduce, _scalar,
                   lowering)
from .builder import GraphBuilder, Ref
from .strided import row_major, view_block


def _dims_arg(args: list, kwargs: dict, position: int = 1) -> list[int]:
    dims = args[position] if len(args) > position else kwargs.get("dim")
    if dims is None:
        return []
    return [dims] if isinstance(dims, int) else list(dims)


def _keepdim(args: list, kwargs: dict, position: int = 2) -> bool:
    return bool(args[position] if len(args) > position else kwargs.get("keepdim", False))


def _argmax(b: GraphBuilder, x: Ref, dim: int | None, keepdim: bool) -> Ref:
    """The position of the largest value along `dim` (all elements flattened when None): the
    index half of a top-1 along the last dim."""
    if dim is None:
        x, dim = b.reshape(x, (-1,)), 0
    last = len(x.shape) - 1
    moved = x if dim == last else b.emit("transpose", [x], dim0=dim, dim1=last)
    index = b.emit("topk_index", [moved], "int64", k=1)
    index = index if dim == last else b.emit("transpose", [index], dim0=dim, dim1=last)
    return index if keepdim else b.emit("squeeze", [index], dim=dim)


@lowering("argmax", "argmin")
def _arg_extreme(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x = args[0]
    dims = _dims_arg(args, kwargs)
    dim = _dim(dims[0], len(x.shape)) if dims else None
    if name == "argmin":
        x = b.emit("neg", [x])
    return b.reshape(_argmax(b, x, dim, _keepdim(args, kwargs)), _out_shape(out))


@lowering("max", "min", "amin")
def _extreme(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """`max`/`min` (whole tensor, or along a dim with indices), `amin`; a minimum is minus the
    maximum of minus x. Two tensors (`max.other`) are `maximum`/`minimum`."""
    x = args[0]
    if len(args) > 1 and isinstance(args[1], Ref):
        return _cast_to(b, b.emit("maximum" if name == "max" else "minimum", [x, args[1]]), out)
    source = b.emit("neg", [x]) if name != "max" else x
    dims = _dims_arg(args, kwargs)
    keepdim = _keepdim(args, kwargs)
    values = _reduce(b, "amax", source, dims, keepdim)
    values = b.emit("neg", [values]) if name != "max" else values
    if name == "amin" or not dims:
        return values
    return values, _argmax(b, source, _dim(dims[0], len(x.shape)), keepdim)


@lowering("mv", "dot", "vdot")
def _mv(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A matrix-vector (or vector-vector) product as a matmul with a column."""
    matrix, vector = args[0], args[1]
    if name != "mv":
        matrix = b.emit("unsqueeze", [matrix], dim=0)
    product = b.emit("matmul", [matrix, b.emit("unsqueeze", [vector], dim=1)])
    product = b.emit("squeeze", [product], dim=1)
    return product if name == "mv" else b.emit("squeeze", [product], dim=0)


@lowering("roll")
def _roll(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Each shift as the last `shift` elements moved to the front: two slices and a concat."""
    x = args[0]
    shifts = args[1] if len(args) > 1 else kwargs["shifts"]
    dims = _dims_arg(args, kwargs, 2)
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    flat = not dims
    if flat:
        x, dims = b.reshape(x, (-1,)), [0]
    for shift, dim in zip(shifts, dims):
        dim = _dim(dim, len(x.shape))
        size = x.shape[dim]
        cut = size - shift % size if size else 0
        if 0 < cut < size:
            x = b.concat([b.emit("slice", [x], dim=dim, start=cut, end=size),
                          b.emit("slice", [x], dim=dim, start=0, end=cut)], dim)
    return b.reshape(x, _out_shape(out)) if flat else x


@lowering("cumsum")
def _cumsum(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A running sum along `dim` as a matmul with an upper-triangular matrix of ones."""
    x = _cast_to(b, args[0], out)
    if not x.shape:
        return x
    dim, last = _dim(args[1], len(x.shape)), len(x.shape) - 1
    size = x.shape[dim]
    iota = b.emit("iota", [], "int64", shape=(size,), start=0, step=1, dtype="int64")
    rows = b.emit("expand", [b.emit("unsqueeze", [iota], dim=1)], dim=1, size=size)
    columns = b.emit("transpose", [rows], dim0=0, dim1=1)
    upper = b.emit("cast", [b.emit("le", [rows, columns], "bool")], x.dtype, dtype=x.dtype)
    moved = x if dim == last else b.emit("transpose", [x], dim0=dim, dim1=last)
    moved = b.emit("unsqueeze", [moved], dim=0) if len(moved.shape) == 1 else moved
    upper = b.broadcast(upper, moved.shape[:-2] + (size, size))
    summed = b.emit("matmul", [moved, upper])
    summed = b.emit("squeeze", [summed], dim=0) if len(x.shape) == 1 else summed
    return summed if dim == last else b.emit("transpose", [summed], dim0=dim, dim1=last)


_LN2, _LN10 = 0.6931471805599453, 2.302585092994046


@lowering("tan", "sinh", "cosh", "expm1", "log1p", "log2", "log10", "sign", "asinh", "acosh",
          "atanh")
def _derived_unary(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Elementwise functions written with the IR's own (tan = sin / cos, ...)."""
    x = _cast_to(b, args[0], out)
    if name == "tan":
        return b.emit("div", [b.emit("sin", [x]), b.emit("cos", [x])])
    if name in ("sinh", "cosh"):
        ups, downs = b.emit("exp", [x]), b.emit("exp", [b.emit("neg", [x])])
        return b.emit("mul_scalar", [b.emit("sub" if name == "sinh" else "add", [ups, downs])],
                      value=0.5)
    if name == "expm1":
        return b.emit("add_scalar", [b.emit("exp", [x])], value=-1.0)
    if name == "sign":
        positive, negative = (b.emit(op, [x], "bool", value=0) for op in ("gt_scalar", "lt_scalar"))
        return b.emit("sub", [_cast_to(b, positive, out), _cast_to(b, negative, out)])
    if name in ("log1p", "log2", "log10"):
        logs = b.emit("log", [b.emit("add_scalar", [x], value=1.0)] if name == "log1p" else [x])
        return logs if name == "log1p" else b.emit(
            "mul_scalar", [logs], value=1.0 / (_LN2 if name == "log2" else _LN10))
    if name == "atanh":  # log((1 + x) / (1 - x)) / 2
        ratio = b.emit("div", [b.emit("add_scalar", [x], value=1.0),
                               b.emit("rsub_scalar", [x], value=1.0)])
        return b.emit("mul_scalar", [b.emit("log", [ratio])], value=0.5)
    root = b.emit("sqrt", [b.emit("add_scalar", [b.emit("mul", [x, x])],
                                  value=1.0 if name == "asinh" else -1.0)])
    return b.emit("log", [b.emit("add", [x, root])])  # asinh, acosh


@lowering("bitwise_xor", "logical_xor")
def _xor(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """On booleans (or as truth values): `x != y`; on integers, bit by bit."""
    x, y = args[0], args[1]
    if name == "bitwise_xor" and out.dtype != torch.bool:
        return _binary(b, name, args, kwargs, out)
    x, y = (v if not isinstance(v, Ref) or v.dtype == "bool" else b.emit("ne_scalar", [v], "bool", value=0)
            for v in (x, y))
    if not isinstance(y, Ref):
        return b.reshape(x, _out_shape(out)) if not y else b.emit("logical_not", [x])
    return b.emit("ne", [b.broadcast(x, _out_shape(out)), b.broadcast(y, _out_shape(out))], "bool")


@lowering("repeat")
def _repeat(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Each dim repeated r times: a new outer dim expanded to r, merged into it."""
    x, repeats = args[0], list(args[1])
    while len(x.shape) < len(repeats):
        x = b.emit("unsqueeze", [x], dim=0)
    for dim, count in enumerate(repeats):
        if count != 1:
            size = x.shape[dim]
            x = b.emit("expand", [b.emit("unsqueeze", [x], dim=dim)], dim=dim, size=count)
            x = b.emit("merge", [x], dim=dim, inner=size)
    return x


@lowering("index_select", "flip")
def _index_along(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Rows picked along one dim by an index tensor (`flip`: a descending arange per dim)."""
    x = args[0]
    if name == "index_select":
        picks = [(_dim(args[1], len(x.shape)), args[2])]
    else:
        picks = [(_dim(d, len(x.shape)), None) for d in args[1]]
    for dim, index in picks:
        if index is None:
            size = x.shape[dim]
            index = b.emit("iota", [], "int64", shape=(size,), start=size - 1, step=-1, dtype="int64")
        shape = x.shape[:dim] + index.shape + x.shape[dim + 1:]
        x = b.emit("index", [x, index], x.dtype, shape=shape,
                   none_positions=tuple(d != dim for d in range(dim + 1)))
    return x


# Buffers: allocated uninitialised, then written whole (copy_, fill_, zero_, a collective).
@lowering("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
          "empty_permuted")
def _empty(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Uninitialised memory: a draw of its own, so a value read before it is written equals
    nothing (a block that a collective then discards, like a broadcast's non-root buffer,
    does not matter)."""
    dtype = _dtype_name(out.dtype)
    return b.emit("uninitialized", [], dtype, shape=_out_shape(out), dtype=dtype,
                  draw=uuid.uuid4().hex)


@lowering("resize")
def _resize(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """`t.resize_(shape)`: the same shape is the tensor as it is; any other shape is taken as
    fresh uninitialised memory (how code uses it: to allocate an `out=` buffer, or to free a
    parameter's storage with `resize_(0)`), so no value kept across it is relied on."""
    if tuple(args[0].shape) == _out_shape(out):
        return args[0]
    return _empty(b, "empty", [], {}, out)


@lowering("copy", "fill", "zero")
def _overwrite(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A whole tensor overwritten: by `src` (broadcast and cast), a value, or zeros."""
    dtype = _dtype_name(out.dtype)
    value = 0 if name == "zero" else args[1]
    if not isinstance(value, Ref):
        return b.emit("full", [], dtype, shape=_out_shape(out), value=_scalar(value), dtype=dtype)
    return _cast_to(b, b.broadcast(value, _out_shape(out)), out)


# as_strided: a view of x's storage, lowered when x is dense and the view takes nested blocks.
@lowering("as_strided")
def _as_strided(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """x's storage flattened in memory order, then for each dim (largest stride first) a slice
    of `size * stride` elements split into `size` rows of `stride`; the first element of what
    is left; stride-0 dims are broadcasts. `kwargs["input_layout"]` (x's strides and storage
    offset) comes from the tracer."""
    x, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    in_stride, in_offset = kwargs["input_layout"]
    start = (in_offset if offset is None else offset) - in_offset
    if list(in_stride) == row_major(x.shape):
        try:
            shape, starts, dims = view_block(x.shape, size, stride, start, name)
        except CaptureError:
            pass  # not a block: read through memory order
        else:
            return _block_read(b, b.reshape(x, shape), size, starts, dims)
    flat = _in_memory_order(b, x, in_stride)
    dims = sorted((d for d in range(len(size)) if stride[d] and size[d] > 1),
                  key=lambda d: -stride[d])
    for outer, inner in zip(dims, dims[1:]):
        if size[inner] * stride[inner] > stride[outer]:
            raise CaptureError("aten.as_strided with overlapping rows is not a plain view")
    for position, dim in enumerate(dims):
        count, step = size[dim], stride[dim]
        last = position == len(dims) - 1 and step == 1
        flat = _window(b, flat, start, count * step)
        if not last:
            flat = b.emit("split", [flat], dim=len(flat.shape) - 1, inner=step)
        start = 0
    if not dims or stride[dims[-1]] != 1:
        flat = b.emit("squeeze", [_window(b, flat, start, 1)], dim=len(flat.shape) - 1)
    order = dims + [d for d in range(len(size)) if d not in dims]
    for _ in order[len(dims):]:
        flat = b.emit("unsqueeze", [flat], dim=len(flat.shape))
    view = b.permute(flat, [order.index(d) for d in range(len(size))])
    return b.broadcast(view, tuple(size))


def _block_read(b: GraphBuilder, x: Ref, size: list[int], starts: list[int],
                dims: list[int | None]) -> Ref:
    """The block of `x` at `starts` whose view dims lie along `dims` (`strided.view_block`):
    slices, the dims the view indexes squeezed, the rest in view order."""
    for dim, start in enumerate(starts):
        extent = size[dims.index(dim)] if dim in dims else 1
        if (start, extent) != (0, x.shape[dim]):
            x = b.emit("slice", [x], dim=dim, start=start, end=start + extent)
    for dim in reversed(range(len(starts))):
        if dim not in dims:
            x = b.emit("squeeze", [x], dim=dim)
    kept = [d for d in dims if d is not None]
    x = b.permute(x, [sorted(kept).index(d) for d in kept])
    for position, dim in enumerate(dims):
        if dim is None:
            x = b.emit("unsqueeze", [x], dim=position)
    return x


def _in_memory_order(b: GraphBuilder, x: Ref, strides: tuple[int, ...]) -> Ref:
    """`x` as a 1-D tensor in the order its elements lie in memory (x must be dense)."""
    order = sorted(range(len(x.shape)), key=lambda d: -strides[d])
    expected = 1
    for dim in reversed(order):
        if x.shape[dim] > 1 and strides[dim] != expected:
            raise CaptureError("aten.as_strided of a tensor that is not dense in memory")
        expected *= x.shape[dim]
    return b.reshape(b.permute(x, order), (expected,))


def _window(b: GraphBuilder, x: Ref, start: int, length: int) -> Ref:
    """Elements [start, start + length) of x's last dim, padded with zeros past its end (never
    read: the view's last row ends inside it)."""
    dim, size = len(x.shape) - 1, x.shape[-1]
    if start < 0 or start >= size:
        raise CaptureError("aten.as_strided outside its input's storage")
    end = min(start + length, size)
    if (start, end) != (0, size):
        x = b.emit("slice", [x], dim=dim, start=start, end=end)
    if start + length > end:
        x = b.emit("pad", [x], dim=dim, before=0, after=start + length - end, value=0)
    return x


# Prims that torch's reference decompositions call (keyed `prims.name`).
@lowering("prims.sum", "prims.prod")
def _prims_sum(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A sum or product over `dims` (all when empty); booleans counted as integers."""
    x, dims, op = args[0], args[1], name.removeprefix("prims.")
    x = b.emit("cast", [x], "int64", dtype="int64") if x.dtype == "bool" else x
    return _cast_to(b, _reduce(b, op, x, list(dims) or list(range(len(x.shape))), False), out)


@lowering("prims.var")
def _prims_var(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """sum((x - mean)^2) / (n - correction) over `dims`."""
    x, dims = args[0], list(args[1]) or list(range(len(args[0].shape)))
    correction = args[2] if len(args) > 2 else kwargs.get("correction", 1)
    count = 1
    for dim in dims:
        count *= x.shape[_dim(dim, len(x.shape))]
    mean = b.emit("mul_scalar", [_reduce(b, "sum", x, dims, True)], value=1.0 / count)
    centered = b.emit("sub", [x, b.broadcast(mean, x.shape)])
    squares = _reduce(b, "sum", b.emit("mul", [centered, centered]), dims, False)
    return _cast_to(b, b.emit("mul_scalar", [squares], value=1.0 / max(count - correction, 0)), out)


@lowering("prims.broadcast_in_dim")
def _broadcast_in_dim(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, shape, kept = args[0], tuple(args[1]), list(args[2])
    for dim in range(len(shape)):
        if dim not in kept:
            x = b.emit("unsqueeze", [x], dim=dim)
    return b.broadcast(x, shape)


@lowering("prims.full", "prims.scalar_tensor")
def _prims_full(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    dtype = _dtype_name(out.dtype)
    value = args[0] if name == "prims.scalar_tensor" else args[1]
    return b.emit("full", [], dtype, shape=_out_shape(out), value=_scalar(value), dtype=dtype)


@lowering("prims.iota")
def _prims_iota(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    dtype = _dtype_name(out.dtype)
    return b.emit("iota", [], dtype, shape=_out_shape(out), start=kwargs.get("start", 0),
                  step=kwargs.get("step", 1), dtype=dtype)


@lowering("prims.collapse_view", "prims.collapse", "prims.reshape", "prims.split_dim")
def _prims_reshape(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    return b.reshape(args[0], _out_shape(out))


@lowering("prims.amax", "prims.amin")
def _prims_extreme(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, dims = args[0], list(args[1]) if args[1] is not None else []
    if name == "prims.amax":
        return _reduce(b, "amax", x, dims, False)
    return b.emit("neg", [_reduce(b, "amax", b.emit("neg", [x]), dims, False)])

