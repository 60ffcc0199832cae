"""The second check that needs no trust in the rules: run the captured graphs on random inputs.

The reference graph and the merged distributed graph are evaluated in float64 (collectives are
sums and concatenations across ranks); the rank outputs, assembled by the expected output
placements, are compared with the reference outputs.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..ir.assumptions import ValueRange
from ..ir.distributed import DistributedGraph, qualified
from ..ir.graph import Graph, Node
from ..ir.ops import OPS
from ..placements import (Custom, Partial, Placement, Replicate, Shard, Stage, slab_name,
                          slabbed)
from .custom import custom_output_values, held_values
from .opaque import opaque_targets
from .relations import output_holders

_FLOATS = {"float32", "float16", "bfloat16", "float64"}
IGNORE_INDEX = -100  # the target id a loss skips


def _value(node: Node, inputs: list[torch.Tensor]) -> torch.Tensor:
    attrs = dict(node.attrs)
    if attrs.get("dtype") in _FLOATS:  # (a cast, a constant, uninitialised memory)
        attrs["dtype"] = "float64"
    if node.op == "all_reduce":
        stacked = torch.stack(inputs)
        return stacked.amax(0) if attrs["reduce"] == "max" else stacked.sum(0)
    if node.op == "all_gather":
        return torch.cat(inputs, 0)
    if node.op == "all_to_all":
        rank = attrs["index"]
        return torch.cat([x.narrow(0, sum(splits[:rank]), splits[rank])
                          for x, splits in zip(inputs, attrs["member_splits"])], 0)
    if node.op == "reduce_scatter":
        total, dim = torch.stack(inputs).sum(0), attrs.get("dim", 0)
        size = node.shape[dim]
        return total.narrow(dim, attrs["index"] * size, size)
    return OPS[node.op].run(inputs, attrs)


def run_graph(graph: Graph, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluate every node; `env` holds the placeholders' values by node name."""
    values = dict(env)
    for node in graph:
        if node.op != "placeholder":
            values[node.name] = _value(node, [values[i] for i in node.inputs])
    return values


def random_inputs(graph: Graph, seed: int = 0,
                  assumed: Mapping[str, ValueRange] | None = None) -> dict[str, torch.Tensor]:
    """Float placeholders ~ N(0, 0.5); integer ids spread evenly below every table they index
    (so vocab shard boundaries are hit); `labels` random targets below the largest table with
    some ignored (-100, unevenly placed, so token-weighted and per-batch means differ); other
    integer inputs (masks) are ones. Inputs with an `assumed` range are clamped into it."""
    gen = torch.Generator().manual_seed(seed)
    limits: dict[str, int] = {}
    for node in graph:
        if node.op == "embedding":
            table, ids = node.inputs
            limits[ids] = min(limits.get(ids, 1 << 30), graph[table].shape[0])
    values = {}
    for node in graph.placeholders():
        if node.dtype in _FLOATS:
            values[node.name] = torch.randn(node.shape, generator=gen, dtype=torch.float64) * 0.5
        elif node.name in limits:
            count = 1
            for size in node.shape:
                count *= size
            spread = torch.arange(count) * limits[node.name] // count  # hits shard boundaries
            values[node.name] = spread[torch.randperm(count, generator=gen)].reshape(node.shape)
        elif node.name == "labels":
            values[node.name] = _labels(node.shape, max(limits.values(), default=2), gen)
        else:
            values[node.name] = torch.ones(node.shape, dtype=getattr(torch, node.dtype))
        bounds = (assumed or {}).get(node.attr("target"))
        if bounds is not None:
            values[node.name] = values[node.name].clamp(bounds.low, bounds.high)
    return values


def _labels(shape: tuple[int, ...], classes: int, gen: torch.Generator) -> torch.Tensor:
    """Targets spread evenly below `classes` in order (so every shard boundary of a
    vocab-parallel loss is a target). Targets off the quarter points are ignored, more often in
    the first half than in the second, so batch rows and micro-batches count different numbers
    of targets (a mean of per-batch means then differs from the token-weighted mean)."""
    count = 1
    for size in shape:
        count *= size
    flat = torch.arange(count)
    labels = flat * classes // count
    ignorable = labels % max(classes // 4, 1) != 0
    chance = torch.where(flat < count // 2, 0.75, 0.25)
    ignored = ignorable & (torch.rand(count, generator=gen) < chance)
    return labels.masked_fill(ignored, IGNORE_INDEX).reshape(shape)


def _rank_value(full: torch.Tensor, placement: Placement, rank: int, world: int) -> torch.Tensor:
    if isinstance(placement, (Replicate, Stage)):  # a Stage tensor is only asked of its rank
        return full
    if isinstance(placement, Partial):
        return full if rank == 0 else torch.zeros_like(full)
    assert isinstance(placement, Shard)
    dim, chunks = placement.dim % full.dim(), placement.chunks(world)
    count = max(chunks) + 1
    blocks = torch.chunk(full, placement.blocks, dim)
    return torch.cat([torch.chunk(block, count, dim)[chunks[rank]] for block in blocks], dim)


def _assemble(outputs: list[torch.Tensor], placement: Placement) -> list[torch.Tensor]:
    """Reference-shaped views of the rank outputs (one per rank for Replicate; for Stage, the
    outputs are those of its one rank)."""
    if isinstance(placement, (Replicate, Stage)):
        return outputs
    if isinstance(placement, Partial):
        return [torch.stack(outputs).sum(0)]
    if isinstance(placement, Custom):
        return custom_output_values(placement, outputs)
    assert isinstance(placement, Shard)
    dim = placement.dim % outputs[0].dim()
    holder = {chunk: rank for rank, chunk in reversed(list(enumerate(placement.chunks(len(outputs)))))}
    pieces = [torch.chunk(outputs[holder[chunk]], placement.blocks, dim) for chunk in sorted(holder)]
    return [torch.cat([part[block] for block in range(placement.blocks) for part in pieces], dim)]


def rank_values(placements: dict[str, Placement], ref_values: dict[str, torch.Tensor], rank: int,
                world: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Rank `rank`'s values of the placeholders named in `shapes` (by their names, with their
    shapes), cut from the reference's values by `placements` (a tensor stacked from slabs, and
    its slabs, from theirs); none for names the reference lacks that no Custom piece fills."""
    stacked = slabbed(placements) & set(shapes)
    wanted = dict(shapes)
    for name in stacked:
        wanted.update({slab_name(name, j): shapes[name][1:] for j in range(shapes[name][0])})
    held = held_values(placements, ref_values, {qualified(rank, name): shape
                                                for name, shape in wanted.items()})
    values = {}
    for name in wanted:
        if qualified(rank, name) in held:
            values[name] = held[qualified(rank, name)]
        elif name in ref_values:
            values[name] = _rank_value(ref_values[name], placements.get(name, Replicate()), rank,
                                       world)
    for name in stacked:
        slabs = [values.get(slab_name(name, j)) for j in range(shapes[name][0])]
        if all(slab is not None for slab in slabs):
            values[name] = torch.stack(slabs)
    return values


def cross_check(ref: Graph, dist: DistributedGraph, placements: dict[str, Placement],
                output_placements: list[Placement], seed: int = 0,
                assumed: Mapping[str, ValueRange] | None = None,
                values: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Max relative error between the reference outputs and the assembled rank outputs (not
    run, `agrees` None, when a graph holds an op with no lowering), on random inputs or on the
    reference placeholders' `values` by name (those of a sampled run, whose reads the graphs
    hold)."""
    unlowered = opaque_targets(ref, dist.graph)
    if unlowered:
        return {"max_relative_error": None, "agrees": None, "seed": seed,
                "skipped": f"not runnable: no lowering for {', '.join(unlowered)}"}
    ref_env = random_inputs(ref, seed, assumed)
    for node in ref.placeholders():
        if values and node.attr("target") in values:
            ref_env[node.name] = values[node.attr("target")].to(ref_env[node.name].dtype)
    ref_values = run_graph(ref, ref_env)
    dist_env = {}
    for rank in range(dist.world_size):
        nodes = [n for n in dist.graph.placeholders() if dist.rank_of(n.name) == rank]
        cut = rank_values(placements, ref_env, rank, dist.world_size,
                          {n.attr("target"): n.shape for n in nodes})
        dist_env.update({n.name: cut[n.attr("target")] for n in nodes if n.attr("target") in cut})
    try:
        dist_values = run_graph(dist.graph, dist_env)
    except (IndexError, RuntimeError) as error:  # the ranks fail on valid inputs: numbers differ
        return {"max_relative_error": float("inf"), "agrees": False, "seed": seed,
                "error": str(error).splitlines()[0]}
    worst = 0.0
    for position, (output, placement) in enumerate(zip(ref.outputs, output_placements)):
        expected = ref_values[output].double()
        scale = expected.abs().max().item() or 1.0
        ranks = [dist_values[dist.rank_outputs[rank][index]].double() for rank, index
                 in output_holders(output_placements, position, dist.world_size)]
        for assembled in _assemble(ranks, placement):
            if assembled.shape != expected.shape:
                worst = float("inf")
                continue
            error = (assembled - expected).abs().max().item() / scale
            worst = max(worst, error if error == error else float("inf"))  # NaN: they differ
    return {"max_relative_error": worst, "agrees": worst <= 1e-9,
            **({"inputs": "the sampled run's"} if values else {"seed": seed})}
