"""Lowers gathers and scatters: one index per row along the last dim as `take` and `untake`
(which rules relate across ranks), a boolean mask filled with a constant as `masked_fill`, and
any other as the uninterpreted op of the same overload."""
from __future__ import annotations

from typing import Any

from .aten import Result, _dim, filled, lowering
from .aten import _one_per_row as _picks_one_per_row
from .builder import GraphBuilder, Ref
from .uninterpreted import apply


@lowering("index_put")
def _index_put(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """`x[mask] = scalar` with one boolean mask over x's leading dims (DTensor's MaskPartial), and
    `x[arange, ids] = v` (or `+= v`) putting one value per row along the last dim."""
    x, indices, values = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if isinstance(values, Ref) and _picks_one_per_row(b, x, list(indices)):
        ids, rows = indices[-1], x.shape[:-1]
        put = values if values.shape == rows else b.broadcast(values, rows)
        if not accumulate:  # what is there is replaced: add the difference
            put = _change(b, put, x, ids) or b.emit("sub", [put, b.emit("take", [x, ids])])
        return b.emit("add", [x, b.emit("untake", [put, ids], size=x.shape[-1])])
    source = b.graph[values.name] if isinstance(values, Ref) and values.shape == () else None
    value = source and (source.attr("value") if source.op == "full" else source.attr("values", [None])[0])
    if (accumulate or len(indices) != 1 or not isinstance(indices[0], Ref)
            or indices[0].dtype != "bool" or value is None):
        return apply(b, "index_put", args, kwargs, out)
    mask = indices[0]
    while len(mask.shape) < len(x.shape):
        mask = b.emit("unsqueeze", [mask], dim=len(mask.shape))
    return filled(b, x, b.broadcast(mask, x.shape), value)


def _change(b: GraphBuilder, values: Ref, x: Ref, ids: Ref) -> Ref | None:
    """What `x[rows, ids] += w` or `-= w` adds: `w` or its negation, when the values put are the
    picks `x[rows, ids]` plus or minus `w` (None for any other values)."""
    node = b.graph[values.name]
    if node.op not in ("add", "sub") or len(node.inputs) != 2:
        return None
    picked, change = (b.graph[name] for name in node.inputs)
    if picked.op != "take" or list(picked.inputs) != [x.name, ids.name]:
        return None
    if change.shape != values.shape:
        return None
    change_ref = Ref(change.name, change.shape, values.dtype)
    return change_ref if node.op == "add" else b.emit("neg", [change_ref])


def _one_per_row(x: Ref, dim: int, index: Ref) -> bool:
    """Whether `index` picks one position along x's last dim for each row."""
    return _dim(dim, len(x.shape)) == len(x.shape) - 1 and index.shape == x.shape[:-1] + (1,)


@lowering("gather")
def _gather(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    x, dim, index = args[:3]
    if not _one_per_row(x, dim, index):
        return apply(b, "gather", args, kwargs, out)
    index = b.emit("squeeze", [index], dim=len(index.shape) - 1)
    return b.emit("unsqueeze", [b.emit("take", [x, index])], dim=len(index.shape))


@lowering("scatter_add")
def _scatter_add(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """`x` plus `src` put at `index` along the last dim (gather's backward, one index per row);
    into zeros it is the `untake` alone."""
    x, dim, index, src = args[:4]
    if not _one_per_row(x, dim, index):
        return apply(b, "scatter_add", args, kwargs, out)
    last = len(index.shape) - 1
    put = b.emit("untake", [b.emit("squeeze", [src], dim=last), b.emit("squeeze", [index], dim=last)],
                 size=x.shape[-1])
    target = b.graph[x.name]
    if target.op == "full" and target.attr("value") == 0:
        return put
    return b.emit("add", [x, put])


@lowering("scatter")
def _scatter(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """Values put into zeros at a top-k's indices along the last dim (top-k's backward): the
    indices of a row are distinct, so the scatter is the sum of one `untake` per column."""
    x, dim, index, src = args[:4]
    last = len(x.shape) - 1
    zeros = b.graph[x.name]
    if (_dim(dim, len(x.shape)) != last or b.graph[index.name].op != "topk_index"
            or zeros.op != "full" or zeros.attr("value") != 0 or not isinstance(src, Ref)
            or len(args) > 4 or kwargs):  # (a `reduce` argument: another op)
        return apply(b, "scatter" if isinstance(src, Ref) else "scatter_value", args, kwargs, out)
    total = None
    for column in range(index.shape[-1]):
        pick = [b.emit("squeeze", [b.emit("slice", [ref], dim=last, start=column, end=column + 1)],
                       dim=last) for ref in (src, index)]
        put = b.emit("untake", pick, size=x.shape[-1])
        total = put if total is None else b.emit("add", [total, put])
    return total
