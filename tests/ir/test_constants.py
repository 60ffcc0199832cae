"""Constant subgraphs (no placeholder below them) are keyed by value, so two programs that build
one constant differently give it one term."""
from __future__ import annotations

from scalify.ir.distributed import constant_terms
from scalify.ir.graph import Graph, Node
from scalify.ir.ops import infer_shape
from scalify.ir.symmetry import RankAffine


def _graph(*nodes: tuple[str, str, tuple[str, ...], tuple]) -> Graph:
    graph = Graph()
    for name, op, inputs, attrs in nodes:
        shape = infer_shape(op, [graph[i].shape for i in inputs], dict(attrs))
        graph.add(Node(name, op, inputs, attrs, shape, "float32"))
    graph.outputs = [nodes[-1][0]]
    return graph


def _iota(name: str, size: int) -> tuple[str, str, tuple[str, ...], tuple]:
    return (name, "iota", (), (("shape", (size,)), ("start", 0), ("step", 1),
                               ("dtype", "float32")))


def _table() -> list[tuple]:
    """A column 0..3 broadcast to three columns."""
    return [_iota("row", 4), ("col", "unsqueeze", ("row",), (("dim", 1),)),
            ("table", "expand", ("col",), (("dim", 1), ("size", 3)))]


def test_a_constant_transposed_twice_has_the_constants_term() -> None:
    plain = _graph(*_table(), ("out", "exp", ("table",), ()))
    twice = _graph(*_table(),
                   ("t", "transpose", ("table",), (("dim0", 0), ("dim1", 1))),
                   ("back", "transpose", ("t",), (("dim0", 0), ("dim1", 1))),
                   ("out", "exp", ("back",), ()))
    assert constant_terms(twice)["back"] == constant_terms(plain)["table"]
    assert constant_terms(twice)["out"] == constant_terms(plain)["out"]
    assert constant_terms(plain)["table"].startswith("(expand")  # broadcasts keep their form


def test_operand_order_of_a_constant_sum_does_not_matter() -> None:
    one = _graph(_iota("a", 4), ("b", "exp", ("a",), ()), ("s", "add", ("a", "b"), ()))
    other = _graph(_iota("a", 4), ("b", "exp", ("a",), ()), ("s", "add", ("b", "a"), ()))
    different = _graph(_iota("a", 4), ("b", "exp", ("a",), ()), ("s", "sub", ("b", "a"), ()))
    assert constant_terms(one)["s"] == constant_terms(other)["s"]
    assert constant_terms(one)["s"] != constant_terms(different)["s"]


def test_rank_dependent_constants_are_keyed_by_structure() -> None:
    """A symbolic program's rank-dependent integer has no one value: never keyed by a value."""
    def first_two(start: object) -> str:
        graph = _graph(_iota("a", 4))
        graph.add(Node("s", "slice", ("a",), (("dim", 0), ("start", start), ("end", 2)), (2,),
                       "float32"))
        return constant_terms(graph)["s"]

    on_every_rank = first_two(RankAffine(0, 0))
    assert len({first_two(RankAffine(2, 0)), on_every_rank, first_two(0)}) == 3


def _zeros(heads: int) -> Graph:
    return _graph(("z", "full", (), (("shape", (2, heads, 8, 8)), ("value", 0.0),
                                     ("dtype", "float32"))))


def test_a_constant_of_one_value_is_the_broadcast_of_that_value() -> None:
    """The whole batch's heads and a rank's heads of `torch.full` share the one-element leaf."""
    whole, part = constant_terms(_zeros(4))["z"], constant_terms(_zeros(2))["z"]
    assert whole.startswith("(expand") and part.startswith("(expand")
    leaf = whole[whole.index("(const"):whole.index(")") + 1]
    assert leaf == part[part.index("(const"):part.index(")") + 1]
    assert "1 4)" in whole and "1 2)" in part


def test_a_broadcast_scalar_of_one_value_is_the_same_broadcast() -> None:
    """`full((1,), 1.0)` unsqueezed and expanded, or `full((12,), 1.0)`: one term."""
    built = _graph(("s", "full", (), (("shape", ()), ("value", 1.0), ("dtype", "float32"))),
                   ("u", "unsqueeze", ("s",), (("dim", 0),)),
                   ("e", "expand", ("u",), (("dim", 0), ("size", 12))))
    whole = _graph(("e", "full", (), (("shape", (12,)), ("value", 1.0), ("dtype", "float32"))))
    assert constant_terms(built)["e"] == constant_terms(whole)["e"]
