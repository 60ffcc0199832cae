"""DTensor support for the dispatch tracer: record each rank's local program, not DTensor's.

A TorchDispatchMode sees an op on DTensors before DTensor does. The tracer defers such ops
(returns NotImplemented), DTensor then runs its sharding propagation, its redistributions
(functional collectives) and the local op on plain tensors, and those reach the tracer again.
Sharding propagation runs ops on fake tensors of global shape: they are kept out of the graph.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor, Shard as DTensorShard
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _disable_current_modes

from ..ir.graph import Graph
from ..placements import Partial, Placement, Shard

_PROPAGATE_META = ShardingPropagator._propagate_tensor_meta_non_cached


def has_dtensor(types: Iterable[type]) -> bool:
    """Whether a dispatched op's tensor-subclass `types` include DTensor."""
    return any(issubclass(kind, DTensor) for kind in types)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: the local shard of a DTensor, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def dtensor_layout(tensor: torch.Tensor) -> tuple:
    """How this rank holds a DTensor parameter: `("shard", dim, chunk, chunks)` when it is cut
    along `dim` over one mesh dim (this rank holding chunk `chunk`), `("partial", ranks)` for a
    sum over a 1-D mesh, `("replicate",)`; `()` for a plain tensor or a layout cut over several
    mesh dims (or strided, as FSDP2 over TP cuts it), which a placement does not state."""
    if not isinstance(tensor, DTensor):
        return ()
    mesh = tensor.device_mesh
    cuts = [(axis, p) for axis, p in enumerate(tensor.placements) if not p.is_replicate()]
    if not cuts:
        return ("replicate",)
    if len(cuts) > 1:
        return ()
    axis, placement = cuts[0]
    if type(placement) is DTensorShard:
        return ("shard", placement.dim, mesh.get_local_rank(axis), mesh.size(axis))
    if placement.is_partial() and mesh.ndim == 1 and placement.reduce_op == "sum":
        return ("partial", tuple(mesh.mesh.flatten().tolist()))
    return ()


def placements_held(rank_graphs: list[Graph]) -> dict[str, Placement]:
    """The placements of the parameters the ranks hold as DTensors (parallelize_module,
    distribute_module, fully_shard), read from each rank's layout: a cut along one dim, or a
    sum over all ranks. Parameters held otherwise are left to the stated placements."""
    world = len(rank_graphs)
    held: dict[str, Placement] = {}
    declared = "the parameter's DTensor placements"
    for node in rank_graphs[0].placeholders():
        layouts = [graph[node.name].attr("layout", ()) if node.name in graph else ()
                   for graph in rank_graphs]
        kinds = {layout[:1] for layout in layouts}
        if kinds == {("shard",)} and len({(layout[1], layout[3]) for layout in layouts}) == 1:
            chunks = tuple(layout[2] for layout in layouts)
            held[node.name] = Shard(layouts[0][1], declared_at=declared, chunk_of_rank=(
                None if chunks == tuple(range(world)) else chunks))
        elif kinds == {("partial",)} and all(layout[1] == tuple(range(world)) for layout in layouts):
            held[node.name] = Partial(declared_at=declared)
    return held


def _propagate_meta_unrecorded(self: ShardingPropagator, op_schema: Any) -> Any:
    # (one fake mode for every propagation: DTensor would make a new one per op, and each
    # FakeTensorMode() reads its creator's stack from the source files, ~10 ms)
    with _disable_current_modes(), tracing(TracingContext(_propagation_fake_mode())):
        return _PROPAGATE_META(self, op_schema)


@cache
def _propagation_fake_mode() -> FakeTensorMode:
    return FakeTensorMode()


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
