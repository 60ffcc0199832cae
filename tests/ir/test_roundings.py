"""A rank factor that rounds a reference factor (1/sqrt(8) against 8 ** -0.5) is written as
the reference's, and the line is named; factors further apart are left as they are."""
import math

from scalify.ir.graph import Graph, Node, SourceLoc
from scalify.ir.roundings import factors_as_reference


def _scaled(factor: float, line: int = 1) -> Graph:
    graph = Graph()
    graph.add(Node("x", "placeholder", (), (("kind", "input"), ("target", "x")), (4,), "float32"))
    graph.add(Node("y", "mul_scalar", ("x",), (("value", factor),), (4,), "float32",
                   SourceLoc("model.py", line, "y = x * scale")))
    graph.outputs = ["y"]
    return graph


def test_a_factor_one_rounding_apart_is_the_references_and_named():
    assert 1 / math.sqrt(8) != 8 ** -0.5
    (rank,), lines = factors_as_reference(_scaled(8 ** -0.5), [_scaled(1 / math.sqrt(8), 7)])
    assert rank["y"].attr("value") == 8 ** -0.5 and lines == ["model.py:7"]


def test_factors_further_apart_or_equal_are_left_as_written():
    for factor in (0.25 + 3 * math.ulp(0.25), 0.5, 0.25):
        (rank,), lines = factors_as_reference(_scaled(0.25), [_scaled(factor)])
        assert rank["y"].attr("value") == factor and not lines
