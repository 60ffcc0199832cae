"""A transpose that undoes its input's transpose is removed before verification."""
from __future__ import annotations

from scalify.ir.graph import Graph, Node
from scalify.ir.simplify import without_double_transposes


def _transpose(name: str, source: str, dims: tuple[int, int], shape: tuple[int, ...]) -> Node:
    return Node(name, "transpose", (source,), (("dim0", dims[0]), ("dim1", dims[1])), shape,
                "float32")


def _graph(second: tuple[int, int]) -> Graph:
    graph = Graph()
    graph.add(Node("x", "placeholder", (), (("shape", (2, 3, 4)), ("target", "x")), (2, 3, 4),
                   "float32"))
    graph.add(_transpose("t", "x", (1, 2), (2, 4, 3)))
    shape = (2, 3, 4) if set(second) == {1, 2} else (4, 2, 3)
    graph.add(_transpose("back", "t", second, shape))
    graph.add(Node("out", "exp", ("back",), (), shape, "float32"))
    graph.outputs = ["out", "back"]
    return graph


def test_a_round_trip_is_its_input() -> None:
    simplified = without_double_transposes(_graph((2, -2)))
    assert "back" not in simplified and simplified["out"].inputs == ("x",)
    assert simplified.outputs == ["out", "x"]
    assert "t" not in simplified  # the inner transpose, now unused


def test_transposes_of_other_dims_stay() -> None:
    simplified = without_double_transposes(_graph((0, 1)))
    assert simplified["out"].inputs == ("back",)
