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


@cache
def _tables() -> dict[Any, Callable]:
    """Every decomposition torch registers; the core-ATen ones (into core ops) take precedence."""
    return {**decomposition_table, **core_aten_decompositions()}


def _composite(func: Any) -> Callable | None:
    """A CompositeImplicitAutograd op's own kernel (ops built from other ops)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return None
    return lambda *args, **kwargs: func.decompose(*args, **kwargs)


def decomposition_of(func: Any) -> Callable | None:
    """How to run `func` as other ops: forced for a few backward ops; otherwise only when no
    lowering covers it (None: lower it, or record it opaque)."""
    if func in FORCED:
        return FORCED[func]
    if lowering_name(func)[0] in LOWERINGS or not isinstance(func, torch._ops.OpOverload):
        return None
    return _tables().get(func) or _composite(func)
