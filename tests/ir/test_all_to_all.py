"""all_to_all: matched across ranks with every member's splits, run by the interpreter as block
r of every member's input, encoded as slices and concats, verified rank by rank."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import scalify
from scalify.ir.distributed import merge_ranks
from scalify.ir.graph import Graph, Node
from scalify.ir.symmetry import symbolic_program
from scalify.verify.encode import encode
from scalify.verify.numeric import run_graph

WORLD = 2


def _program(rank: int, splits: tuple[int, ...]) -> Graph:
    rows = sum(splits)
    graph = Graph(outputs=["y"])
    graph.add(Node("x", "placeholder", (), (("target", "x"),), (rows, 3), "float32"))
    received = 2 * splits[rank]  # both ranks send the same splits
    graph.add(Node("y", "all_to_all", ("x",), (("group", (0, 1)), ("in_splits", splits),
                                                ("shape", (received, 3))), (received, 3), "float32"))
    return graph


def test_each_rank_receives_its_block_of_every_members_input():
    merged = merge_ranks([_program(r, (1, 3)) for r in range(WORLD)])
    node = merged.graph["r1/y"]
    assert node.inputs == ("r0/x", "r1/x") and node.attr("member_splits") == ((1, 3), (1, 3))
    x0, x1 = torch.arange(12.0).reshape(4, 3), -torch.arange(12.0).reshape(4, 3)
    values = run_graph(merged.graph, {"r0/x": x0, "r1/x": x1})
    assert torch.equal(values["r0/y"], torch.cat([x0[:1], x1[:1]]))
    assert torch.equal(values["r1/y"], torch.cat([x0[1:], x1[1:]]))
    term = encode(node, ["A", "B"], [(4, 3), (4, 3)])
    assert term == "(concat (slice A 0 1 4) (slice B 0 1 4) 0 3 3)"


def test_all_to_all_keeps_the_per_rank_path():
    program, why = symbolic_program([_program(r, (2, 2)) for r in range(WORLD)])
    assert program is None and "all_to_all is verified rank by rank" in why


class Rows(nn.Module):
    def forward(self, x):
        return x * 2


class RankRows(nn.Module):
    """Sends its own row block of x to every rank, so that each receives all of x."""

    def forward(self, x):
        rank, rows = dist.get_rank(), x.shape[0] // WORLD
        sent = torch.cat([x[rank * rows:(rank + 1) * rows]] * WORLD)
        return funcol.all_to_all_single(sent, None, None, dist.group.WORLD) * 2


def test_row_blocks_sent_to_every_rank_verify_as_the_whole():
    x = torch.empty(4, 3, device="meta")
    report = scalify.verify_modules(Rows(), lambda rank: RankRows(), WORLD, (x,), numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]
