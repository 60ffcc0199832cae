"""The lines that decided a rank value's scale and layout: the chain that carries it (moved,
reduced over ranks, scaled) back to the op that computed it, and the cuts of the parameters
and inputs it depends on."""
from scalify.ir.graph import Graph, Node, SourceLoc
from scalify.verify.upstream import chain_lines, cut_lines


def _at(line: int) -> SourceLoc:
    return SourceLoc("model.py", line)


def _graph() -> Graph:
    """w cut at line 10, x @ w at 11, scaled at 12, all-reduced at 13, transposed at 14."""
    graph = Graph()
    for node in [
        Node("w", "placeholder", (), (), (4, 8), "float32"),
        Node("x", "placeholder", (), (), (3, 8), "float32"),
        Node("cut", "slice", ("w",), (("dim", 0), ("start", 0), ("end", 2)), (2, 8), "float32",
             _at(10)),
        Node("t", "transpose", ("cut",), (("dim0", 0), ("dim1", 1)), (8, 2), "float32", _at(11)),
        Node("mm", "matmul", ("x", "t"), (), (3, 2), "float32", _at(11)),
        Node("half", "mul_scalar", ("mm",), (("value", 0.5),), (3, 2), "float32", _at(12)),
        Node("sum", "all_reduce", ("half",), (("group", (0, 1)), ("reduce", "sum")), (3, 2),
             "float32", _at(13)),
        Node("out", "transpose", ("sum",), (("dim0", 0), ("dim1", 1)), (2, 3), "float32",
             _at(14)),
    ]:
        graph.add(node)
    return graph


def test_the_chain_runs_back_through_collectives_and_scalings_to_the_op_that_computed_it():
    assert [loc.line for loc in chain_lines(_graph(), "out")] == [14, 13, 12, 11]


def test_the_cuts_are_the_slices_of_parameters_the_value_depends_on():
    assert [loc.line for loc in cut_lines(_graph(), "out")] == [10]
