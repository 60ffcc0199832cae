"""Rank tensors stacked from pieces, held as their slabs.

A sharding function that stacks per-expert weights into one tensor (vLLM's FusedMoE `w13`,
torchtitan's grouped experts) gives a rank tensor whose slab j along dim 0 is made of pieces
of reference tensors (`capture/shard_fn.py` names it `name@j`). The rank program reads the
stacked tensor; this pass makes each such placeholder the concatenation, along dim 0, of its
slabs (unsqueezed), each a placeholder of its own that the pieces relate to the reference.
"""
from __future__ import annotations

import dataclasses

from ..placements import slab_name
from .graph import Graph, Node, SourceLoc


def held_as_slabs(graph: Graph, stacked: set[str]) -> Graph:
    """`graph` with every placeholder whose target is in `stacked` built from its slabs."""
    if not any(node.op == "placeholder" and node.attr("target") in stacked for node in graph):
        return graph
    out = Graph(outputs=list(graph.outputs), sampled_reads=graph.sampled_reads)
    for node in graph:
        if node.op != "placeholder" or node.attr("target") not in stacked:
            out.add(node)
            continue
        target, slab_shape = node.attr("target"), node.shape[1:]
        parts = []
        for j in range(node.shape[0]):
            name = slab_name(target, j)
            attrs = tuple((key, name if key == "target" else slab_shape if key == "shape"
                           else value) for key, value in node.attrs)
            out.add(Node(name, "placeholder", (), attrs, slab_shape, node.dtype,
                         SourceLoc(module=name)))
            parts.append(out.add(Node(f"{name}.unsqueeze", "unsqueeze", (name,), (("dim", 0),),
                                      (1, *slab_shape), node.dtype, node.source)).name)
        out.add(dataclasses.replace(node, op="concat", inputs=tuple(parts), attrs=(("dim", 0),)))
    return out
