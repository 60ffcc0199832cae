"""Lowers a parsed HLO module (capture/hlo_text.py) into core IR ops, one graph per device.

An SPMD module is one program every device runs; `lower_module(module, device, world_size)`
gives device `device`'s graph: its collectives name the group holding it, `partition-id` and
`replica-id` are its id, and `collective-permute` becomes sends and receives to its peers.
Every node carries the Python source line its instruction's metadata records, and its `code`
is the instruction's HLO text (`HLO line N: %name = ...`), since the Python files are not at hand.

A constant whose values the dump elides (`constant({...})`) becomes an input named after the
instruction (kind "constant"): its value is unknown, so it is related like any other input.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import CaptureError
from ..ir.graph import Graph
from .builder import GraphBuilder, Ref
from .hlo_groups import group_of, parse_replica_groups
from .hlo_source import source_of
from .hlo_text import Computation, HloModule, HloShape, Instruction, parse_module

Value = Ref | tuple  # a tuple-shaped instruction is a tuple of values

DTYPES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
          "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64", "f16": "float16",
          "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


@dataclass
class Lowering:
    """What an op's lowering sees: the builder, the module, and the device being lowered."""

    b: GraphBuilder
    module: HloModule
    device: int
    world_size: int


OpLowering = Callable[[Lowering, Instruction, list[Value]], Value]
LOWERINGS: dict[str, OpLowering] = {}


def lowering(*opcodes: str) -> Callable[[OpLowering], OpLowering]:
    def register(fn: OpLowering) -> OpLowering:
        for opcode in opcodes:
            LOWERINGS[opcode] = fn
        return fn
    return register


def dtype_of(shape: HloShape) -> str:
    if shape.dtype not in DTYPES:
        raise CaptureError(f"unsupported HLO element type {shape.dtype}")
    return DTYPES[shape.dtype]


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]


def _fail(ins: Instruction, why: str) -> CaptureError:
    return CaptureError(f"HLO line {ins.line} (%{ins.name}, {ins.opcode}): {why}: {ins.text[:160]}")


def _scalar(text: str, dtype: str) -> Any:
    text = text.strip()
    if dtype == "bool":
        return int(text == "true")
    if text in ("inf", "-inf", "nan"):
        return float(text)
    return int(text) if dtype.startswith(("int", "uint")) else float(text)


# Data and identities.
@lowering("parameter")
def _parameter(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit_placeholder(ins.name, "parameter", ins.shape.dims, dtype_of(ins.shape))


@lowering("constant")
def _constant(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    dtype, shape = dtype_of(ins.shape), ins.shape.dims
    if "..." in ins.payload:  # values elided by the dump
        return lo.b.emit_placeholder(ins.name, "constant", shape, dtype)
    values = [_scalar(v, dtype) for v in re.findall(r"[^\s{},]+", ins.payload)]
    if not shape:
        return lo.b.emit("full", [], dtype, shape=(), value=values[0], dtype=dtype)
    return lo.b.emit("literal", [], dtype, shape=shape, values=tuple(values), dtype=dtype)


@lowering("iota")
def _iota(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    dtype, shape = dtype_of(ins.shape), ins.shape.dims
    dim = int(ins.attrs["iota_dimension"])
    line = lo.b.emit("iota", [], dtype, shape=(shape[dim],), start=0, step=1, dtype=dtype)
    return _broadcast_into(lo.b, line, shape, [dim])


@lowering("partition-id", "replica-id")
def _device_id(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit("full", [], "uint32", shape=(), value=lo.device, dtype="uint32")


@lowering("tuple")
def _tuple(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return tuple(args)


@lowering("get-tuple-element")
def _get_tuple_element(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return args[0][int(ins.attrs["index"])]


@lowering("copy", "optimization-barrier", "all-reduce-done")
def _copy(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return args[0]


# Elementwise.
_UNARY = {"exponential": "exp", "log": "log", "negate": "neg", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "sine": "sin", "cosine": "cos", "tanh": "tanh", "logistic": "sigmoid", "abs": "abs",
          "erf": "erf"}
_BINARY = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div",
           "maximum": "maximum", "minimum": "minimum", "power": "pow"}
_LOGICAL = {"and": ("logical_and", "bitwise_and"), "or": ("logical_or", "bitwise_or"),
            "not": ("logical_not", "bitwise_not")}
_COMPARE = {"EQ": "eq", "NE": "ne", "LT": "lt", "LE": "le", "GT": "gt", "GE": "ge"}


@lowering(*_UNARY)
def _unary(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit(_UNARY[ins.opcode], args)


@lowering(*_BINARY)
def _binary(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit(_BINARY[ins.opcode], args)


@lowering(*_LOGICAL)
def _logical(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    logical, bitwise = _LOGICAL[ins.opcode]
    return lo.b.emit(logical if args[0].dtype == "bool" else bitwise, args)


@lowering("compare")
def _compare(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit(_COMPARE[ins.attrs["direction"]], args, "bool")


@lowering("select")
def _select(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.emit("where", args, args[1].dtype)


def _cast(b: GraphBuilder, x: Ref, dtype: str) -> Ref:
    return x if x.dtype == dtype else b.emit("cast", [x], dtype, dtype=dtype)


@lowering("convert")
def _convert(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return _cast(lo.b, args[0], dtype_of(ins.shape))


# Movement.
def _broadcast_into(b: GraphBuilder, x: Ref, shape: tuple[int, ...], dims: list[int]) -> Ref:
    """x with its dim i placed at output dim dims[i], new dims inserted, size-1 dims stretched."""
    order = sorted(range(len(dims)), key=dims.__getitem__)
    x = b.permute(x, order)
    placed = sorted(dims)
    for position in range(len(shape)):
        if position not in placed:
            x = b.emit("unsqueeze", [x], dim=position)
    return b.broadcast(x, shape)


@lowering("broadcast")
def _broadcast(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return _broadcast_into(lo.b, args[0], ins.shape.dims, _ints(ins.attrs.get("dimensions", "")))


@lowering("reshape", "bitcast")
def _reshape(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.reshape(args[0], ins.shape.dims)


@lowering("transpose")
def _transpose(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.permute(args[0], _ints(ins.attrs["dimensions"]))


def _slice_dims(b: GraphBuilder, x: Ref, bounds: list[tuple[int, int]]) -> Ref:
    for dim, (start, end) in enumerate(bounds):
        if (start, end) != (0, x.shape[dim]):
            x = b.emit("slice", [x], dim=dim, start=start, end=end)
    return x


@lowering("slice")
def _slice(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    bounds = []
    for spec in re.findall(r"\[([^\]]*)\]", ins.attrs["slice"]):
        start, end, *step = _ints(spec)
        if step and step[0] != 1:
            raise _fail(ins, "a slice with a stride other than 1 is not supported")
        bounds.append((start, end))
    return _slice_dims(lo.b, args[0], bounds)


def _starts(lo: Lowering, ins: Instruction, refs: list[Ref], sizes: tuple[int, ...],
            shape: tuple[int, ...]) -> list[int]:
    """Constant start indices, clamped as HLO clamps them (the window stays inside)."""
    starts = []
    for ref, size, full in zip(refs, sizes, shape):
        node = lo.b.graph[ref.name]
        if node.op != "full":
            raise _fail(ins, "start indices computed at run time are not supported")
        starts.append(min(max(int(node.attr("value")), 0), full - size))
    return starts


@lowering("dynamic-slice")
def _dynamic_slice(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    x, sizes = args[0], tuple(_ints(ins.attrs["dynamic_slice_sizes"]))
    starts = _starts(lo, ins, args[1:], sizes, x.shape)
    return _slice_dims(lo.b, x, [(s, s + size) for s, size in zip(starts, sizes)])


def _placed(b: GraphBuilder, x: Ref, update: Ref, starts: list[int], dim: int) -> Ref:
    """x with `update` written at `starts`, built along dims `dim`.. as concats of x's parts
    before and after it."""
    if dim == len(x.shape):
        return update
    start, size, full = starts[dim], update.shape[dim], x.shape[dim]
    middle = x if size == full else b.emit("slice", [x], dim=dim, start=start, end=start + size)
    parts = [_placed(b, middle, update, starts, dim + 1)]
    if start:
        parts.insert(0, b.emit("slice", [x], dim=dim, start=0, end=start))
    if start + size < full:
        parts.append(b.emit("slice", [x], dim=dim, start=start + size, end=full))
    return b.concat(parts, dim) if len(parts) > 1 else parts[0]


@lowering("dynamic-update-slice")
def _dynamic_update_slice(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    x, update = args[0], args[1]
    return _placed(lo.b, x, update, _starts(lo, ins, args[2:], update.shape, x.shape), 0)


@lowering("concatenate")
def _concatenate(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    return lo.b.concat(list(args), _ints(ins.attrs["dimensions"])[0])


# Reductions.
_REDUCERS = {"add": ("sum", "add", 0.0), "maximum": ("amax", "maximum", float("-inf"))}


def _reducer(lo: Lowering, ins: Instruction) -> tuple[str, str, float]:
    called = lo.module.computations.get(ins.attrs.get("to_apply", "").lstrip("%"))
    root = next((i for i in called.instructions if i.name == called.root), None) if called else None
    if root is None or root.opcode not in _REDUCERS:
        raise _fail(ins, f"reducer {root.opcode if root else '?'} is not supported (add or maximum)")
    return _REDUCERS[root.opcode]


@lowering("reduce")
def _reduce(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    if len(args) != 2:
        raise _fail(ins, "a reduce of several operands is not supported")
    op, combine, identity = _reducer(lo, ins)
    b, x, init = lo.b, args[0], args[1]
    dims = sorted(_ints(ins.attrs["dimensions"]))
    for dim in dims:
        x = b.emit(op, [x], dim=dim)
    for dim in reversed(dims):
        x = b.emit("squeeze", [x], dim=dim)
    start = b.graph[init.name]
    if not (start.op == "full" and float(start.attr("value")) == identity):
        x = b.emit(combine, [x, b.broadcast(init, x.shape)])
    return x


# Products.
@lowering("dot")
def _dot(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    """A dot with batch and contracting dims as a batched matmul: each operand permuted to
    [batch, free, contracting] (lhs) or [batch, contracting, free] (rhs), the free and contracting
    runs merged into one dim each, then the result's free dims split back out."""
    b, (lhs, rhs) = lo.b, args
    lb, lc = _ints(ins.attrs.get("lhs_batch_dims", "")), _ints(ins.attrs.get("lhs_contracting_dims", ""))
    rb, rc = _ints(ins.attrs.get("rhs_batch_dims", "")), _ints(ins.attrs.get("rhs_contracting_dims", ""))
    lf = [d for d in range(len(lhs.shape)) if d not in lb + lc]
    rf = [d for d in range(len(rhs.shape)) if d not in rb + rc]
    batch = [lhs.shape[d] for d in lb]
    left = _grouped(b, b.permute(lhs, lb + lf + lc), len(lb), [len(lf), len(lc)])
    right = _grouped(b, b.permute(rhs, rb + rc + rf), len(lb), [len(rc), len(rf)])
    product = b.emit("matmul", [left, right])
    free = [lhs.shape[d] for d in lf] + [rhs.shape[d] for d in rf]
    return _cast(b, b.reshape(product, tuple(batch + free)), dtype_of(ins.shape))


def _grouped(b: GraphBuilder, x: Ref, lead: int, runs: list[int]) -> Ref:
    """x with each run of dims after the first `lead` merged into one dim (a length-0 run
    becomes a new dim of size 1)."""
    sizes, position = list(x.shape[:lead]), lead
    for run in runs:
        size = 1
        for s in x.shape[position:position + run]:
            size *= s
        sizes.append(size)
        position += run
    return b.reshape(x, tuple(sizes))


@lowering("gather")
def _gather(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    """A gather of whole slices along one dim (`x[indices]` on dim k): as an `index` op on x
    with dim k moved to the front, then the output dims put where the gather places them."""
    b, (x, indices) = lo.b, args
    collapsed = _ints(ins.attrs.get("collapsed_slice_dims", ""))
    mapped = _ints(ins.attrs.get("start_index_map", ""))
    sizes = _ints(ins.attrs["slice_sizes"])
    vector_dim = int(ins.attrs.get("index_vector_dim", len(indices.shape)))
    if (len(mapped) != 1 or collapsed != mapped or ins.attrs.get("operand_batching_dims")
            or any(s != (1 if d == mapped[0] else n) for d, (s, n) in enumerate(zip(sizes, x.shape)))):
        raise _fail(ins, "only gathers of whole slices along one dim are supported")
    if vector_dim < len(indices.shape):
        indices = b.emit("squeeze", [indices], dim=vector_dim)
    dim = mapped[0]
    rest = [d for d in range(len(x.shape)) if d != dim]
    moved = b.permute(x, [dim] + rest)
    shape = indices.shape + tuple(x.shape[d] for d in rest)
    gathered = b.emit("index", [moved, indices], shape=shape, none_positions=(False,))
    offsets = _ints(ins.attrs["offset_dims"])
    batch = iter(range(len(indices.shape)))
    order = [len(indices.shape) + offsets.index(p) if p in offsets else next(batch)
             for p in range(len(shape))]
    return b.permute(gathered, order)


# Custom calls that leave the value unchanged: Neuron's data transfer, and the sharding marks
# of XLA's SPMD partitioner (on a device's local shard, as the programs lowered here hold it).
IDENTITY_CALLS = ("AwsNeuronTransferWithStaticRing", "Sharding", "SPMDFullToShardShape",
                  "SPMDShardToFullShape")


@lowering("custom-call")
def _custom_call(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    target = ins.attrs.get("custom_call_target", "").strip('"')
    if target in IDENTITY_CALLS:
        return args[0]
    if target == "AwsNeuronRmsNorm":
        return _rms_norm(lo, ins, args)
    raise _fail(ins, f"custom-call target {target!r} has no lowering to the core IR")


def _rms_norm(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    """x * rsqrt(mean(x^2) + eps) * weight over the dim whose size is the weight's, the result
    in the instruction's type (Neuron's kernel takes no dim: the weight's size names it)."""
    b, (x, weight, eps) = lo.b, args
    dims = [d for d, size in enumerate(x.shape) if size == weight.shape[0]]
    if len(weight.shape) != 1 or len(dims) != 1:
        raise _fail(ins, "cannot tell which dim the RMS norm normalises (weight size is ambiguous)")
    dim, node = dims[0], b.graph[eps.name]
    if node.op != "full":
        raise _fail(ins, "the RMS norm's epsilon must be a constant")
    mean = b.emit("mul_scalar", [b.emit("sum", [b.emit("mul", [x, x])], dim=dim)],
                  value=1.0 / x.shape[dim])
    rstd = b.emit("rsqrt", [b.emit("add_scalar", [mean], value=node.attr("value"))])
    normed = b.emit("mul", [x, b.broadcast(rstd, x.shape)])
    scaled = b.emit("mul", [normed, _broadcast_into(b, weight, x.shape, [dim])])
    return _cast(b, scaled, dtype_of(ins.shape))


# Collectives: the group is the replica group that holds this device.
def _group(lo: Lowering, ins: Instruction) -> tuple[int, ...]:
    return group_of(parse_replica_groups(ins.attrs.get("replica_groups", "{}"), lo.world_size),
                    lo.device)


def _along(b: GraphBuilder, x: Ref, dim: int, make: Callable[[Ref], Ref]) -> Ref:
    """`make` applied with `dim` moved to the front (collectives that act on dim 0)."""
    if dim == 0:
        return make(x)
    moved = make(b.emit("transpose", [x], dim0=0, dim1=dim))
    return b.emit("transpose", [moved], dim0=0, dim1=dim)


@lowering("all-reduce", "all-reduce-start")
def _all_reduce(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    if len(args) != 1:
        raise _fail(ins, "an all-reduce of several operands is not supported")
    reduce = "max" if _reducer(lo, ins)[0] == "amax" else "sum"
    return lo.b.emit("all_reduce", args, reduce=reduce, group=_group(lo, ins))


@lowering("all-gather")
def _all_gather(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    group, dim = _group(lo, ins), _ints(ins.attrs["dimensions"])[0]

    def gather(x: Ref) -> Ref:
        return lo.b.emit("all_gather", [x], shape=(x.shape[0] * len(group),) + x.shape[1:],
                         group=group)
    return _along(lo.b, args[0], dim, gather)


@lowering("reduce-scatter")
def _reduce_scatter(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    reduce = "max" if _reducer(lo, ins)[0] == "amax" else "sum"
    dim = _ints(ins.attrs["dimensions"])[0]
    attrs = {"dim": dim} if dim else {}
    return lo.b.emit("reduce_scatter", args, shape=ins.shape.dims, reduce=reduce,
                     group=_group(lo, ins), **attrs)


@lowering("all-to-all")
def _all_to_all(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    dims = _ints(ins.attrs.get("dimensions", ""))
    if len(args) != 1 or len(dims) != 1:
        raise _fail(ins, "only the array form of all-to-all (one operand, one dim) is supported")
    group = _group(lo, ins)

    def exchange(x: Ref) -> Ref:
        rows = x.shape[0] // len(group)
        return lo.b.emit("all_to_all", [x], shape=x.shape, in_splits=(rows,) * len(group),
                         group=group)
    return _along(lo.b, args[0], dims[0], exchange)


@lowering("collective-permute")
def _collective_permute(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    """Sends to each target this device is a source for; receives from its source, or zeros."""
    pairs = [tuple(_ints(p)) for p in re.findall(r"\{(\d+\s*,\s*\d+)\}", ins.attrs["source_target_pairs"])]
    b, x = lo.b, args[0]
    for source, target in pairs:
        if source == lo.device:
            b.emit("send", [x], peer=target, tag=0)
    sources = [source for source, target in pairs if target == lo.device]
    if sources:
        return b.emit("recv", [], x.dtype, shape=x.shape, peer=sources[0], tag=0)
    return b.broadcast(b.emit("full", [], x.dtype, shape=(), value=0, dtype=x.dtype), x.shape)


# Driver.
def _flatten(value: Value) -> list[Ref]:
    return [r for v in value for r in _flatten(v)] if isinstance(value, tuple) else [value]


def _lower_instruction(lo: Lowering, ins: Instruction, values: dict[str, Value]) -> Value:
    fn = LOWERINGS.get(ins.opcode)
    if fn is None:
        raise _fail(ins, f"unsupported HLO op {ins.opcode!r} (no lowering to the core IR)")
    missing = [o for o in ins.operands if o not in values]
    if missing:
        raise _fail(ins, f"operands {missing} are not defined before this instruction")
    lo.b.source = replace(source_of(ins.attrs.get("metadata", ""), lo.module.stack),
                          code=f"HLO line {ins.line}: {ins.text.split(', metadata=')[0]}")
    try:
        value = fn(lo, ins, [values[o] for o in ins.operands])
    except (ValueError, KeyError, IndexError) as error:
        raise _fail(ins, f"cannot lower ({error})") from None
    if isinstance(value, Ref) and value.shape != ins.shape.dims:
        raise _fail(ins, f"the lowering gives shape {list(value.shape)}, the instruction declares "
                         f"{list(ins.shape.dims)}")
    return value


def _lower_body(lo: Lowering, computation: Computation, args: list[Value] | None) -> Value:
    """The computation's root value; its parameters are `args` (None: the program's inputs)."""
    values: dict[str, Value] = {}
    for ins in computation.instructions:
        if args is not None and ins.opcode == "parameter":
            values[ins.name] = args[int(ins.payload)]
        else:
            values[ins.name] = _lower_instruction(lo, ins, values)
    return values[computation.root]


@lowering("call", "fusion")
def _call(lo: Lowering, ins: Instruction, args: list[Value]) -> Value:
    """The called computation, inlined."""
    name = (ins.attrs.get("to_apply") or ins.attrs.get("calls", "")).lstrip("%")
    if name not in lo.module.computations:
        raise _fail(ins, f"calls unknown computation {name!r}")
    return _lower_body(lo, lo.module.computations[name], args)


def lower_computation(lo: Lowering, computation: Computation) -> Graph:
    lo.b.graph.outputs = [r.name for r in _flatten(_lower_body(lo, computation, None))]
    return lo.b.graph


def lower_module(module: HloModule, device: int = 0, world_size: int = 1) -> Graph:
    """Device `device`'s program: the entry computation in core ops."""
    lo = Lowering(GraphBuilder(), module, device, world_size)
    return lower_computation(lo, module.entry_computation)


def read_hlo(text: str, device: int = 0, world_size: int = 1) -> Graph:
    """Parse HLO text and lower it for one device."""
    return lower_module(parse_module(text), device, world_size)
