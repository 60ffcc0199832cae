"""A rank tensor stacked from pieces is held as its slabs, concatenated back."""
import torch

from scalify.ir.graph import Graph, Node
from scalify.ir.slabs import held_as_slabs
from scalify.verify.numeric import run_graph


def _program() -> Graph:
    graph = Graph(outputs=["y"])
    graph.add(Node("w", "placeholder", (), (("kind", "param"), ("shape", (2, 3)), ("target", "w")),
                   (2, 3), "float32"))
    graph.add(Node("y", "neg", ("w",), (), (2, 3), "float32"))
    return graph


def test_a_stacked_placeholder_is_the_concatenation_of_its_slabs() -> None:
    held = held_as_slabs(_program(), {"w"})
    slabs = [node for node in held.placeholders()]
    assert [(n.attr("target"), n.shape) for n in slabs] == [("w@0", (3,)), ("w@1", (3,))]
    w = torch.randn(2, 3, dtype=torch.float64)
    values = run_graph(held, {"w@0": w[0], "w@1": w[1]})
    assert torch.equal(values["y"], -w)


def test_a_graph_with_no_stacked_placeholder_is_left_as_it_is() -> None:
    program = _program()
    assert held_as_slabs(program, {"v"}) is program
