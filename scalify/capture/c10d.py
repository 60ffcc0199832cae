"""Lowers in-place c10d collectives (what `dist.all_reduce`, `dist.all_gather`, ... dispatch)
into the IR's collectives, and names the tensors each one overwrites.

The process group arrives as a ProcessGroup script object: it resolves to global ranks here.
Broadcast is the root's block of an all_gather; reduce is an all_reduce on every rank (only the
root's result is defined, so any value elsewhere is right).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CaptureError
from .aten import _all_gather, _all_to_all, _reduce_scatter
from .builder import GraphBuilder, Ref

Rebind = list[tuple[torch.Tensor, Ref]]  # each overwritten tensor and its new value
_REDUCTIONS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max",
               dist.ReduceOp.MIN: "min"}


def is_group(arg: Any) -> bool:
    """Whether a c10d op's argument is its process group (a script object, as its reduce op is)."""
    return isinstance(arg, torch.ScriptObject) and "ProcessGroup" in arg._type().qualified_name()


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a c10d op's process group (a script object)."""
    return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(group)))


def _reduction(op: Any) -> str:
    name = _REDUCTIONS.get(op.op())
    if name is None:
        raise CaptureError(f"a c10d collective reducing with {op.op()} is not supported")
    return name


def _reduced(b: GraphBuilder, x: Ref, reduce: str, ranks: tuple[int, ...]) -> Ref:
    """An all_reduce of x: a sum, a max, a min (minus the max of minus x) or a mean."""
    if reduce == "min":
        return b.emit("neg", [b.emit("all_reduce", [b.emit("neg", [x])], reduce="max",
                                     group=ranks)])
    total = b.emit("all_reduce", [x], reduce="sum" if reduce == "avg" else reduce, group=ranks)
    return b.emit("mul_scalar", [total], value=1.0 / len(ranks)) if reduce == "avg" else total


def _allreduce(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    (tensor,), group, op = args[:3]
    return [(tensor, _reduced(b, ref(tensor), _reduction(op), group_ranks(group)))]


def _allgather_base(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    output, source, group = args[:3]
    return [(output, _all_gather(b, "all_gather", [ref(source), None, group_ranks(group)], {}, output))]


def _allgather(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    """Into a list: one all_gather, then each member's block."""
    (outputs,), (source,), group = args[:3]
    gathered = _gathered(b, ref(source), group_ranks(group))
    rows = source.shape[0]
    return [(output, b.emit("slice", [gathered], dim=0, start=k * rows, end=(k + 1) * rows))
            for k, output in enumerate(outputs)]


def _gathered(b: GraphBuilder, x: Ref, ranks: tuple[int, ...]) -> Ref:
    shape = (x.shape[0] * len(ranks),) + x.shape[1:]
    return b.emit("all_gather", [x], shape=shape, group=ranks)


def _reduce_scatter_base(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    output, source, group, op = args[:4]
    return [(output, _scattered(b, ref(source), output, _reduction(op), group_ranks(group)))]


def _reduce_scatter_list(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    (output,), (sources,), group, op = args[:4]
    stacked = b.concat([ref(source) for source in sources], 0)
    return [(output, _scattered(b, stacked, output, _reduction(op), group_ranks(group)))]


def _scattered(b: GraphBuilder, x: Ref, output: torch.Tensor, reduce: str,
               ranks: tuple[int, ...]) -> Ref:
    if reduce not in ("sum", "avg"):
        raise CaptureError(f"a c10d reduce_scatter reducing with {reduce} is not supported")
    result = _reduce_scatter(b, "reduce_scatter", [x, "sum", len(ranks), ranks], {}, output)
    return b.emit("mul_scalar", [result], value=1.0 / len(ranks)) if reduce == "avg" else result


def _alltoall_base(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    output, source, group, output_splits, input_splits = args[:5]
    return [(output, _all_to_all(b, "all_to_all", [ref(source), list(output_splits),
                                                    list(input_splits), group_ranks(group)], {}, output))]


def _broadcast(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    """The root's tensor on every member: its block of an all_gather."""
    (tensor,), group, root = args[:3]
    x = ref(tensor)
    flat = _as_rows(b, x)
    rows = flat.shape[0]
    block = b.emit("slice", [_gathered(b, flat, group_ranks(group))], dim=0, start=root * rows,
                   end=(root + 1) * rows)
    return [(tensor, b.emit("squeeze", [block], dim=0) if not x.shape else block)]


def _scatter(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    """The root's list, one tensor per member: every member gathers the root's list stacked
    (the others give zeros of its shape) and keeps its own block of the root's."""
    (output,), sources, group, root = args[:4]
    ranks, rows = group_ranks(group), (output.shape[0] if output.dim() else 1)
    if sources and sources[0]:
        stacked = b.concat([_as_rows(b, ref(t)) for t in sources[0]], 0)
    else:
        dtype = str(output.dtype).removeprefix("torch.")
        stacked = b.emit("full", [], dtype, shape=(rows * len(ranks), *output.shape[1:]),
                         value=0, dtype=dtype)
    start = (root * len(ranks) + dist.ProcessGroup.unbox(group).rank()) * rows
    block = b.emit("slice", [_gathered(b, stacked, ranks)], dim=0, start=start, end=start + rows)
    return [(output, block if output.dim() else b.emit("squeeze", [block], dim=0))]


def _gather(b: GraphBuilder, args: tuple, ref: Callable) -> Rebind:
    """Every member's tensor on the root: the root's blocks of an all_gather (the others
    receive nothing)."""
    outputs, (source,), group = args[:3]
    gathered = _gathered(b, _as_rows(b, ref(source)), group_ranks(group))
    rows = source.shape[0] if source.dim() else 1
    blocks = [b.emit("slice", [gathered], dim=0, start=k * rows, end=(k + 1) * rows)
              for k in range(len(outputs[0]) if outputs else 0)]
    return [(output, block if source.dim() else b.emit("squeeze", [block], dim=0))
            for output, block in zip(outputs[0] if outputs else [], blocks)]


def _as_rows(b: GraphBuilder, x: Ref) -> Ref:
    """x with a leading dim to gather along (a 0-dim tensor becomes one row)."""
    return b.emit("unsqueeze", [x], dim=0) if not x.shape else x


LOWERINGS: dict[str, Callable[[GraphBuilder, tuple, Callable], Rebind]] = {
    "allreduce_": _allreduce, "reduce_": _allreduce, "_allgather_base_": _allgather_base,
    "allgather_": _allgather, "_reduce_scatter_base_": _reduce_scatter_base,
    "reduce_scatter_": _reduce_scatter_list, "alltoall_base_": _alltoall_base,
    "broadcast_": _broadcast, "scatter_": _scatter, "gather_": _gather,
}


def overwritten(args: tuple) -> list[torch.Tensor]:
    """The tensors an in-place collective writes (its first argument, flattened)."""
    found, stack = [], [args[0]]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack[:0] = list(item)
    return found

