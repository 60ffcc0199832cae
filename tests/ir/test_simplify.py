"""A transpose that undoes its input's transpose, and a pure op applied again to the same inputs,
are removed before verification."""
from __future__ import annotations

from scalify.ir.graph import Graph, Node
from scalify.ir.simplify import without_double_transposes, without_repeats


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


def _twice(op: str) -> Graph:
    """`op` applied twice to the same inputs with the same attributes, each copy read."""
    graph = Graph()
    for name in "xy":
        graph.add(Node(name, "placeholder", (), (("shape", (2, 3)), ("target", name)), (2, 3),
                       "float32"))
    inputs = ("x", "y") if op == "sub" else ("x",)
    attrs = (("group", (0, 1)), ("reduce", "sum")) if op == "all_reduce" else ()
    graph.add(Node("first", op, inputs, attrs, (2, 3), "float32"))
    graph.add(Node("again", op, inputs, attrs, (2, 3), "float32"))
    graph.add(Node("out", "mul", ("first", "again"), (), (2, 3), "float32"))
    graph.outputs = ["out", "again"]
    return graph


def test_a_repeated_pure_op_is_its_first_application() -> None:
    simplified = without_repeats(_twice("sub"))
    assert "again" not in simplified and simplified["out"].inputs == ("first", "first")
    assert simplified.outputs == ["out", "first"]


def test_collectives_stay_apart() -> None:
    assert "again" in without_repeats(_twice("all_reduce"))
