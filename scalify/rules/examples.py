"""Random tensors for rule examples."""
from __future__ import annotations

import torch


def tensor(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values in (0.5, 1.5): positive, so log/sqrt/rsqrt stay finite."""
    return torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5


def concat_parts(gen: torch.Generator, shape: tuple[int, ...], dim: int, first: int) -> dict:
    """Two tensors `a`, `b` that concatenate along `dim` into `shape`, split after `first`."""
    a_shape, b_shape = list(shape), list(shape)
    a_shape[dim], b_shape[dim] = first, shape[dim] - first
    return {"a": tensor(gen, *a_shape), "b": tensor(gen, *b_shape), "d": dim, "na": first,
            "nb": shape[dim] - first}
