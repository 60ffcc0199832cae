"""Complex tensors as pairs of reals: the core IR has no complex dtype, so a complex tensor of
shape S is held as the real tensor of shape S + (2,) that `torch.view_as_real` gives (real and
imaginary parts last). Each op on complex tensors is re-run here on those pairs with real ops,
which the tracer records as usual: rotary embeddings written with `view_as_complex` and a
complex product (Meta's Llama, torchtitan) become the real arithmetic they stand for.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from ..errors import CaptureError

Pairs = Callable[[torch.Tensor], torch.Tensor]  # a complex tensor's pairs (a real tensor as is)
aten = torch.ops.aten


MAKERS = frozenset({aten.view_as_complex, aten.polar, aten.complex})  # complex from reals
_VALUES = frozenset({aten.view_as_real, aten.resolve_conj, aten.resolve_neg, aten._conj,
                     aten.conj_physical, aten.conj, aten._neg_view, aten.real, aten.imag,
                     aten.mul, aten.add, aten.sub, aten.cat})
_MOVEMENT = frozenset({aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.unsqueeze,
                       aten.squeeze, aten.slice, aten.select, aten.permute, aten.transpose,
                       aten.index, aten.clone, aten.alias, aten.detach, aten._to_copy,
                       aten.lift_fresh})


def lowers(func: Any, operands: Any) -> bool:
    """Whether the op reads or makes a complex tensor and is lowered here (any other op on
    complex tensors takes the tracer's usual path: an FFT is an uninterpreted function)."""
    packet = func.overloadpacket
    return packet in MAKERS or (packet in _VALUES or packet in _MOVEMENT) and any(
        isinstance(t, torch.Tensor) and t.is_complex() for t in tree_leaves(operands))


def held_as(tensor: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of the IR node holding `tensor` (a complex one as its pairs)."""
    if tensor.is_complex():
        return (*tensor.shape, 2), str(tensor.real.dtype).removeprefix("torch.")
    return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def _dim(dim: int, ndim: int) -> int:
    """A dim of a complex tensor of `ndim` dims, as a dim of its pairs (the same, non-negative)."""
    return dim + ndim if dim < 0 else dim


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ar, ai, br, bi = a[..., 0], a[..., 1], b[..., 0], b[..., 1]
    return torch.stack([ar * br - ai * bi, ar * bi + ai * br], dim=-1)


def _elementwise(func: Any, args: tuple, pairs: Pairs) -> torch.Tensor:
    """A product, sum or difference of complex tensors (a real operand scales both parts of a
    product; it adds to the real part of a sum)."""
    a, b = args[0], args[1]
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype)
    complex_a, complex_b = a.is_complex(), b.is_complex()
    pa = pairs(a) if complex_a else a
    pb = pairs(b) if complex_b else b
    if func is aten.mul.Tensor:
        if complex_a and complex_b:
            return _product(pa, pb)
        return pa * pb.unsqueeze(-1) if complex_a else pa.unsqueeze(-1) * pb
    sign = -1.0 if func is aten.sub.Tensor else 1.0
    if not (complex_a and complex_b):
        raise CaptureError(f"{func} of a complex and a real tensor has no lowering")
    return pa + sign * pb


def _movement(func: Any, args: tuple, out: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """A view or copy of a complex tensor: the same movement of its pairs."""
    z, rest = args[0], args[1:]
    p, ndim = pairs(z), z.dim()
    packet = func.overloadpacket
    if packet in (aten.view, aten._unsafe_view, aten.reshape):  # (row-major either way)
        return p.reshape(*out.shape, 2)
    if packet is aten.expand:
        return p.expand(*out.shape, 2)
    if packet is aten.unsqueeze:
        return p.unsqueeze(_dim(rest[0], ndim + 1))
    if packet is aten.squeeze:
        dims = rest[0] if rest else [d for d in range(ndim) if z.shape[d] == 1]
        for dim in sorted((_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)),
                          reverse=True):
            p = p.squeeze(dim)
        return p
    if packet is aten.slice:
        dim, start, end, step = [*rest, *(0, None, None, 1)[len(rest):]]
        return aten.slice.Tensor(p, _dim(dim, ndim), start, end, step)
    if packet is aten.select:
        return p.select(_dim(rest[0], ndim), rest[1])
    if packet is aten.permute:
        return p.permute(*(_dim(d, ndim) for d in rest[0]), ndim)
    if packet is aten.transpose:
        return p.transpose(_dim(rest[0], ndim), _dim(rest[1], ndim))
    if packet is aten.index:
        return aten.index.Tensor(p, list(rest[0]))
    if packet in (aten.clone, aten.alias, aten.detach, aten._to_copy, aten.lift_fresh):
        return p.clone()
    raise CaptureError(f"{func} on a complex tensor has no lowering")


def lowered(func: Any, args: tuple, kwargs: dict, out: Any, pairs: Pairs) -> torch.Tensor:
    """The pairs of `out` (or `out` itself, where it is real) computed from the op's operands
    with real ops; `pairs` gives an operand's pairs."""
    packet = func.overloadpacket
    if packet is aten.view_as_complex:
        return pairs(args[0])
    if packet in (aten.view_as_real, aten.resolve_conj, aten.resolve_neg):  # pairs hold values
        return pairs(args[0])
    if packet in (aten._conj, aten.conj_physical, aten.conj):
        p = pairs(args[0])
        return torch.stack([p[..., 0], -p[..., 1]], dim=-1)
    if packet is aten._neg_view:
        return -pairs(args[0])
    if packet in (aten.real, aten.imag):
        return pairs(args[0])[..., 0 if packet is aten.real else 1]
    if packet is aten.polar:
        magnitude, angle = args
        return torch.stack([magnitude * torch.cos(angle), magnitude * torch.sin(angle)], dim=-1)
    if packet is aten.complex:
        return torch.stack(list(args), dim=-1)
    if func in (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor) and kwargs.get("alpha", 1) == 1:
        return _elementwise(func, args, pairs)
    if packet is aten.cat:
        tensors, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
        return torch.cat([pairs(t) for t in tensors], dim=_dim(dim, tensors[0].dim()))
    if isinstance(out, torch.Tensor) and out.is_complex() and isinstance(args[0], torch.Tensor):
        return _movement(func, args, out, pairs)
    raise CaptureError(f"{func} on complex tensors has no lowering")
