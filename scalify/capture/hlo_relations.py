"""Infers how a reference HLO program's inputs relate to an SPMD program's per-device inputs.

- Inputs are matched by position: parameters by parameter number, elided constants (inputs
  too, see capture/hlo.py) in order of appearance; matched inputs must have the same rank.
- Equal shapes: Replicate. One dim N times larger in the reference: Shard(dim), unless the
  programs cut that dim into blocks (a fused weight, e.g. [q | k | v] columns): when the
  reference slices the product of the input along that dim into blocks that tile it, each
  divisible by N, and the devices slice their product along it too, each block is split N ways
  and every device holds its share of each block, block by block: a Custom placement with one
  Piece per block and device. The blocks come from the reference alone, so a device program
  that slices its blocks wrongly is reported, not taken as its layout.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.graph import Graph, Node
from ..placements import Custom, Piece, Placement, Replicate, Shard
from .hlo_text import HloModule

Shape = tuple[int, ...]


def _inputs(module: HloModule) -> list[str]:
    entry = module.entry_computation
    constants = [i.name for i in entry.instructions if i.opcode == "constant" and "..." in i.payload]
    return [p.name for p in entry.parameters()] + constants


def match_inputs(reference: HloModule, distributed: HloModule) -> dict[str, str]:
    """For each of the distributed program's inputs, the reference input it holds (a part of)."""
    ref_names, dist_names = _inputs(reference), _inputs(distributed)
    if len(ref_names) != len(dist_names):
        raise ShapeError(f"the reference program has {len(ref_names)} inputs and the distributed "
                         f"one {len(dist_names)}: they cannot be matched by position")
    return dict(zip(dist_names, ref_names))


def rename_inputs(graph: Graph, names: dict[str, str]) -> Graph:
    """`graph` with its placeholders renamed by `names` (and every use of them)."""
    renamed = Graph(outputs=[names.get(o, o) for o in graph.outputs])
    for node in graph:
        new = names.get(node.name, node.name)
        attrs = tuple((k, new if k == "target" else v) for k, v in node.attrs)
        renamed.add(Node(new, node.op, tuple(names.get(i, i) for i in node.inputs),
                         attrs if node.op == "placeholder" else node.attrs, node.shape,
                         node.dtype, node.source))
    return renamed


def _follow(graph: Graph, users: dict[str, list[str]], name: str, dim: int) -> set[tuple[int, int]]:
    """The (start, end) of every slice taken along `dim` of `name`'s value, followed through
    transposes, unary ops and matrix products (where the dim is a free dim of an operand)."""
    found, stack, seen = set(), [(name, dim)], set()
    while stack:
        current, d = stack.pop()
        if (current, d) in seen:
            continue
        seen.add((current, d))
        for user in users[current]:
            node = graph[user]
            target = _dim_through(graph, node, current, d)
            if node.op == "slice" and node.attr("dim") == d:
                found.add((node.attr("start"), node.attr("end")))
            elif target is not None:
                stack.append((user, target))
    return found


def _dim_through(graph: Graph, node: Node, source: str, dim: int) -> int | None:
    """Where dim `dim` of input `source` lands in `node`'s output, if it passes through whole."""
    if node.op == "transpose":
        swap = {node.attr("dim0"): node.attr("dim1"), node.attr("dim1"): node.attr("dim0")}
        return swap.get(dim, dim)
    if node.op in ("cast", "neg", "mul_scalar"):
        return dim
    if node.op == "matmul":
        rank = len(node.shape)
        if node.inputs[1] == source and dim == rank - 1:
            return rank - 1
        if node.inputs[0] == source and dim == rank - 2:
            return rank - 2
    return None


def _blocks(cuts: set[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The dim [0, size) cut at every slice boundary, when the slices tile it exactly."""
    points = sorted({0, size, *(p for cut in cuts for p in cut)})
    blocks = list(zip(points, points[1:]))
    return blocks if cuts and set(blocks) == cuts else []


def _fused(name: str, dim: int, ref_blocks: list[tuple[int, int]], world: int) -> Custom | None:
    """Every block split `world` ways, the ranks' shares of each block laid out block by block
    in each rank's tensor; None unless there are several blocks that split evenly."""
    if len(ref_blocks) < 2 or any((end - start) % world for start, end in ref_blocks):
        return None
    pieces, local = [], 0
    for start, end in ref_blocks:
        size = (end - start) // world
        pieces += [Piece(rank, name, local, start + rank * size, size) for rank in range(world)]
        local += size
    return Custom(dim, tuple(pieces), declared_at=f"inferred for {name} from the slices of its "
                                                  "product in both programs")


def _by_shape(what: str, ref_shape: Shape, local_shape: Shape, world: int) -> Placement:
    """Replicate for equal shapes, Shard(dim) for one dim split `world` ways, else ShapeError."""
    where = f"inferred for {what} from its shapes {list(ref_shape)} and {list(local_shape)}"
    differ = [d for d, (a, b) in enumerate(zip(ref_shape, local_shape)) if a != b]
    if len(ref_shape) == len(local_shape) and not differ:
        return Replicate(declared_at=where)
    if len(ref_shape) != len(local_shape) or len(differ) != 1 or \
            ref_shape[differ[0]] != world * local_shape[differ[0]]:
        raise ShapeError(f"{what}: reference shape {list(ref_shape)} and per-device shape "
                         f"{list(local_shape)} are neither equal nor one dim split {world} ways")
    return Shard(differ[0], declared_at=where)


def infer_placement(reference: Graph, rank: Graph, name: str, world: int) -> Placement:
    """The placement of reference input `name`, held by rank inputs of the same name."""
    placement = _by_shape(name, reference[name].shape, rank[name].shape, world)
    if not isinstance(placement, Shard):
        return placement
    dim = placement.dim
    ref_blocks = _blocks(_follow(reference, reference.users(), name, dim), reference[name].shape[dim])
    fused = _fused(name, dim, ref_blocks, world) if _follow(rank, rank.users(), name, dim) else None
    return fused or placement


def infer_placements(reference: Graph, rank: Graph, world: int) -> dict[str, Placement]:
    """The placement of every reference input (the rank graph's inputs carry the same names)."""
    return {node.name: infer_placement(reference, rank, node.name, world)
            for node in reference.placeholders()}


def infer_output_placements(reference: Graph, rank: Graph, world: int) -> list[Placement]:
    """Each output's expected placement from its shapes (Replicate or Shard)."""
    return [_by_shape(f"output {position}", reference[ref_name].shape, rank[rank_name].shape, world)
            for position, (ref_name, rank_name) in enumerate(zip(reference.outputs, rank.outputs))]
