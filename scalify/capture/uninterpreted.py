"""Lowers aten ops with no algebraic rules worth having (convolution, pooling, FFTs, sorting,
distances, bags of embeddings) to the IR op that applies the overload as an uninterpreted
function (ir/uninterpreted.py): identical calls on the reference and a rank still match."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import CaptureError
from ..ir.uninterpreted import APPLICATIONS, MAX_INPUTS
from .aten import Result, _dtype_name, lowering
from .builder import GraphBuilder, Ref


def apply(b: GraphBuilder, op: str, args: list, kwargs: dict, out: Any) -> Result:
    """`out` as uninterpreted op `op` of the call's tensors and other arguments: one node per
    tensor output (`output` numbers them when there are several)."""
    inputs, attrs = APPLICATIONS[op].attributes(args, kwargs, lambda v: isinstance(v, Ref))
    if len(inputs) > MAX_INPUTS:
        raise CaptureError(f"{op} of {len(inputs)} tensors: the prover's uninterpreted functions "
                           f"take at most {MAX_INPUTS}")
    if not isinstance(out, (tuple, list)):
        return b.emit(op, inputs, _dtype_name(out.dtype), **attrs)
    return [b.emit(op, inputs, _dtype_name(t.dtype), output=k, **attrs)
            if isinstance(t, torch.Tensor) else None for k, t in enumerate(out)]


_OVERLOADS = {APPLICATIONS[op].overload.overloadpacket.__name__: op for op in (
    "convolution", "convolution_backward", "avg_pool2d", "avg_pool2d_backward", "avg_pool3d",
    "adaptive_avg_pool2d_backward", "adaptive_avg_pool3d", "cdist", "pdist", "embedding_bag",
    "embedding_bag_forward_only", "fft_r2c", "fft_c2r", "sort", "masked_scatter", "scatter_reduce")}


@lowering(*_OVERLOADS)
def _uninterpreted(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    stable = name == "sort" and "stable" in kwargs  # (its own overload)
    return apply(b, "sort_stable" if stable else _OVERLOADS[name], args, kwargs, out)
