"""Finds PyTorch's own decomposition of an op the lowerings do not cover, to record its pieces."""
from __future__ import annotations

from functools import cache
from typing import Any, Callable

import torch
from torch._decomp import core_aten_decompositions, decomposition_table, get_decompositions

from .aten import LOWERINGS, lowering_name

_aten = torch.ops.aten
# Backward ops recorded as the core ops torch's own decompositions spell them in, though a
# lowering of the same name exists or could be written.
FORCED = get_decompositions([
    _aten._softmax_backward_data, _aten.silu_backward,
    _aten.gelu_backward, _aten.tanh_backward, _aten.sigmoid_backward, _aten.threshold_backward,
    _aten.native_layer_norm_backward])


def _integer_clamp(x: torch.Tensor, min: Any = None, max: Any = None) -> torch.Tensor:
    """An integer clamp by numbers as the fills it is (`t < lo` to lo, `t > hi` to hi), the
    form of a masked index (vocab parallelism clamps its shifted ids, then zeroes the rows a
    mask excludes: rules/embedding.py); any other clamp as PyTorch's decomposition spells it."""
    bounds = [v for v in (min, max) if v is not None]
    if (x.is_floating_point() or x.is_complex() or not all(type(v) is int for v in bounds)
            or (len(bounds) == 2 and min > max)):
        return _tables()[_aten.clamp.default](x, min, max)
    below = x < min if min is not None else None
    above = x > max if max is not None else None  # (of the unclamped values, as lo <= hi)
    if below is not None:
        x = x.masked_fill(below, min)
    return x if above is None else x.masked_fill(above, max)


# Ops Scalify records as other ops its own way (each says why).
OWN = {_aten.clamp.default: _integer_clamp}


@cache
def _tables() -> dict[Any, Callable]:
    """Every decomposition torch registers; the core-ATen ones (into core ops) take precedence."""
    return {**decomposition_table, **core_aten_decompositions()}


def _composite(func: Any) -> Callable | None:
    """A CompositeImplicitAutograd op's own kernel (ops built from other ops)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return None
    return lambda *args, **kwargs: func.decompose(*args, **kwargs)


# A foreach op's name past `_foreach_` where the per-tensor op is named otherwise.
_FOREACH_PER_TENSOR = {"norm": "linalg_vector_norm"}


def _foreach(func: Any) -> Callable | None:
    """A `_foreach_<op>` (PyTorch's optimizers and gradient clipping on a GPU: one kernel over
    a list of tensors) as `<op>` on each tensor of the list, with the matching element of every
    argument that is a list as long as it and the rest as they are. Arguments pass by name:
    one the per-tensor op names otherwise (`scalars` for `value`, `tensors1` for `end`) takes
    the first of its names left."""
    name = func.overloadpacket.__name__
    base = name.removeprefix("_foreach_")
    per_tensor = getattr(_aten, _FOREACH_PER_TENSOR.get(base, base), None)
    if base == name or per_tensor is None or func._schema.arguments[0].name != "self":
        return None
    schema = getattr(per_tensor, "default", None) or getattr(per_tensor, per_tensor.overloads()[0])
    accepted = [a.name for a in schema._schema.arguments][1:]
    theirs = [a.name for a in func._schema.arguments][1:]
    unnamed = iter(n for n in accepted if n not in theirs)
    names = [n if n in accepted else next(unnamed, n) for n in theirs]
    lists = {names[i] for i, a in enumerate(func._schema.arguments[1:])
             if isinstance(a.type, torch.ListType)}  # one element per tensor

    def each(tensors: list, *args: Any, **kwargs: Any) -> list | None:
        given = {**dict(zip(names, args)), **{names[theirs.index(k)]: v for k, v in kwargs.items()}}
        results = [per_tensor(t, **{k: v[i] if k in lists else v for k, v in given.items()})
                   for i, t in enumerate(tensors)]
        return None if base.endswith("_") else results
    return each


def decomposition_of(func: Any) -> Callable | None:
    """How to run `func` as other ops: forced for a few backward ops; otherwise only when no
    lowering covers it (None: lower it, or record it opaque)."""
    if func in FORCED:
        return FORCED[func]
    if func in OWN:
        return OWN[func]
    if lowering_name(func)[0] in LOWERINGS or not isinstance(func, torch._ops.OpOverload):
        return None
    return _tables().get(func) or _composite(func) or _foreach(func)
