"""Rank symmetry: one symbolic program when ranks differ only by rank-affine integers."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import scalify
from scalify.ir.graph import Graph, Node
from scalify.ir.symmetry import RankAffine, symbolic_program

WORLD = 4


def _program(rank: int, value: int, group: tuple[int, ...] = tuple(range(WORLD))) -> Graph:
    graph = Graph(outputs=["s"])
    graph.add(Node("x", "placeholder", (), (("target", "x"),), (2, 3), "float32"))
    graph.add(Node("a", "add_scalar", ("x",), (("value", value),), (2, 3), "float32"))
    graph.add(Node("s", "all_reduce", ("a",), (("group", group), ("reduce", "sum")), (2, 3),
                   "float32"))
    return graph


def test_rank_affine_integers_become_symbolic():
    program, why = symbolic_program([_program(r, 5 * r + 1) for r in range(WORLD)])
    assert why == "used" and program.symbolic and program.world_size == WORLD
    assert program.graph["r0/a"].attr("value") == RankAffine(5, 1)
    assert program.graph["r0/s"].attr("family") == WORLD


def _renamed(graph: Graph, names: dict[str, str]) -> Graph:
    renamed = Graph(outputs=[names.get(o, o) for o in graph.outputs])
    for node in graph:
        renamed.add(Node(names.get(node.name, node.name), node.op,
                         tuple(names.get(i, i) for i in node.inputs), node.attrs, node.shape,
                         node.dtype))
    return renamed


def test_ranks_whose_tracer_numbered_nodes_apart_are_one_program():
    graphs = [_program(r, 5 * r + 1) for r in range(WORLD)]
    graphs[1] = _renamed(graphs[1], {"a": "a2", "s": "s2"})
    program, why = symbolic_program(graphs)
    assert why == "used" and program.graph["r0/a"].attr("value") == RankAffine(5, 1)


def test_non_affine_difference_keeps_the_per_rank_path():
    program, why = symbolic_program([_program(r, r * r) for r in range(WORLD)])
    assert program is None and "add_scalar attribute value differs across ranks" in why


def test_sub_group_collective_keeps_the_per_rank_path():
    program, why = symbolic_program([_program(r, 0, group=(0, 1)) for r in range(WORLD)])
    assert program is None and "sub-group" in why


def _block(rank: int, columns: int) -> Graph:
    """Rank `rank` takes block `rank` of 2 columns out of `columns`."""
    graph = Graph(outputs=["b"])
    graph.add(Node("x", "placeholder", (), (("target", "x"),), (2, columns), "float32"))
    graph.add(Node("b", "slice", ("x",), (("dim", 1), ("start", 2 * rank), ("end", 2 * rank + 2)),
                   (2, 2), "float32"))
    return graph


def test_own_blocks_are_symbolic_only_where_they_tile_the_dim():
    program, why = symbolic_program([_block(r, 2 * WORLD) for r in range(WORLD)])
    assert why == "used" and program.graph["r0/b"].attr("start") == RankAffine(2, 0)
    program, why = symbolic_program([_block(r, 2 * WORLD + 1) for r in range(WORLD)])
    assert program is None and "not the rank's own block" in why


class Scale(nn.Module):
    def __init__(self, weight_rows: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, weight_rows, bias=False)

    def forward(self, x):
        return self.proj(x)


class RankScale(Scale):
    """Column-parallel projection, gathered; the last rank also doubles its part (a bug)."""

    def __init__(self, rank: int, buggy: bool) -> None:
        super().__init__(16 // WORLD)
        self.last = buggy and rank == WORLD - 1

    def forward(self, x):
        local = super().forward(x)
        if self.last:
            local = local * 2
        return funcol.all_gather_single(local, local.dim() - 1, dist.group.WORLD)


def _verify(buggy: bool):
    with torch.device("meta"):
        reference = Scale(16)
    return scalify.verify_modules(
        reference, lambda rank: RankScale(rank, buggy).to("meta"), WORLD,
        {"x": torch.empty(2, 8, device="meta")}, {"proj.weight": scalify.Shard(0)},
        output_placements=[scalify.Replicate()], numeric=True)


def test_gathered_columns_verify_as_one_program():
    report = _verify(buggy=False)
    assert report.stats["rank_symmetry"] == "used"
    assert report.verified and report.numeric["agrees"]


def test_a_bug_on_one_rank_only_is_caught_by_the_per_rank_path():
    report = _verify(buggy=True)
    assert "the ranks' programs differ" in report.stats["rank_symmetry"]
    assert not report.verified and not report.numeric["agrees"]
