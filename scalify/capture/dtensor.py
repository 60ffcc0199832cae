"""DTensor support for the dispatch tracer: record each rank's local program, not DTensor's.

A TorchDispatchMode sees an op on DTensors before DTensor does. The tracer defers such ops
(returns NotImplemented), DTensor then runs its sharding propagation, its redistributions
(functional collectives) and the local op on plain tensors, and those reach the tracer again.
Sharding propagation runs ops on fake tensors of global shape: they are kept out of the graph.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _disable_current_modes

_PROPAGATE_META = ShardingPropagator._propagate_tensor_meta_non_cached


def has_dtensor(types: Iterable[type]) -> bool:
    """Whether a dispatched op's tensor-subclass `types` include DTensor."""
    return any(issubclass(kind, DTensor) for kind in types)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: the local shard of a DTensor, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _propagate_meta_unrecorded(self: ShardingPropagator, op_schema: Any) -> Any:
    with _disable_current_modes():
        return _PROPAGATE_META(self, op_schema)


@contextmanager
def sharding_propagation_unrecorded() -> Iterator[None]:
    """Run DTensor's shape propagation (fake tensors, global shapes) with no mode active."""
    ShardingPropagator._propagate_tensor_meta_non_cached = _propagate_meta_unrecorded
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = _PROPAGATE_META


def clear_sharding_caches() -> None:
    """Forget cached sharding decisions: they hold the device mesh (and group) of the last rank."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
