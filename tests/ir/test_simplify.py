"""A transpose that undoes its input's transpose, a pure op applied again to the same inputs, a
norm raised to its order again and an addition of zero are removed before verification."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from scalify.capture.tracer import capture
from scalify.ir.graph import Graph, Node, SourceLoc
from scalify.ir.simplify import (simplified_ranks, without_concat_picks,
                                 without_double_transposes, without_repeats, without_root_powers,
                                 without_unit_powers, without_zero_fills, without_zero_shifts)
from scalify.verify.numeric import run_graph


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


def test_the_first_application_names_the_line_that_computed_it_again() -> None:
    graph = _twice("sub")
    located = Graph()
    for node in graph:
        line = {"first": 40, "again": 48}.get(node.name)
        located.add(replace(node, source=SourceLoc("case.py", line)) if line else node)
    located.outputs = graph.outputs
    assert without_repeats(located)["first"].source.passed_at == ("case.py:48",)


def test_collectives_stay_apart() -> None:
    assert "again" in without_repeats(_twice("all_reduce"))


def _captured(program, x: torch.Tensor) -> Graph:
    return capture(nn.Module(), lambda: program(x), {"x": x})


def _same_numbers(before: Graph, after: Graph, x: torch.Tensor) -> bool:
    values = [run_graph(graph, {"x": x}) for graph in (before, after)]
    return all(torch.allclose(values[0][a].double(), values[1][b].double())
               for a, b in zip(before.outputs, after.outputs))


def _ops(graph: Graph) -> list[str]:
    return [node.op for node in graph if node.op != "placeholder"]


def _clipping_norm(x):
    """Gradient clipping's total: norms squared, summed from Python's 0 into `zeros(1)`."""
    total = torch.zeros(1)
    total += sum(torch.norm(g) ** 2 for g in x.chunk(2))
    return total ** 0.5


def test_a_norm_squared_is_its_sum_of_squares_and_zero_is_added_to_nothing() -> None:
    x = torch.randn(4, 3)
    graph = _captured(_clipping_norm, x)
    simplified = without_zero_shifts(without_zero_fills(without_root_powers(graph)))
    assert _ops(graph).count("pow_scalar") == 7 and "add_scalar" in _ops(graph)
    assert _ops(simplified).count("pow_scalar") == 3  # the squares and the final root
    assert "add_scalar" not in _ops(simplified) and "full" not in _ops(simplified)
    assert _same_numbers(graph, simplified, x)


def _norm_of_norms(x):
    """PyTorch's clip total: the norms stacked, one of them halved (DTensor's share of a
    replicated norm), and the stack's norm."""
    first, second = x.chunk(2)
    return torch.stack([torch.norm(first), torch.norm(second) / 2]).norm()


def test_a_power_of_roots_gathered_and_scaled_is_their_bases_gathered_and_scaled() -> None:
    x = torch.randn(4, 3)
    graph = _captured(_norm_of_norms, x)
    simplified = without_root_powers(graph)
    assert _ops(graph).count("pow_scalar") == 6
    assert _ops(simplified).count("pow_scalar") == 3  # the squares and the final root
    assert _same_numbers(graph, simplified, x)


def _reduced_norm(group: tuple[int, ...]):
    """A norm reduced over ranks as DTensor reduces a norm: squared, summed, rooted; then
    squared again by the next norm."""
    def graph(sign: float) -> Graph:
        g = Graph()
        g.add(Node("x", "placeholder", (), (("shape", (3,)), ("target", "x")), (3,), "float32"))
        g.add(Node("sq", "pow_scalar", ("x",), (("value", 2),), (3,), "float32"))
        signed = "sq"
        if sign < 0:  # this rank gives the sum a value that may be negative
            g.add(Node("neg", "neg", ("sq",), (), (3,), "float32"))
            signed = "neg"
        g.add(Node("sum", "all_reduce", (signed,), (("group", group), ("reduce", "sum")), (3,),
                   "float32"))
        g.add(Node("root", "pow_scalar", ("sum",), (("value", 0.5),), (3,), "float32"))
        g.add(Node("again", "pow_scalar", ("root",), (("value", 2.0),), (3,), "float32"))
        g.outputs = ["again"]
        return g
    return graph


def test_a_root_of_a_sum_over_ranks_cancels_only_when_every_rank_gives_a_non_negative_value():
    make = _reduced_norm((0, 1))
    both = simplified_ranks([make(1.0), make(1.0)])
    assert all(_ops(g) == ["pow_scalar", "all_reduce"] for g in both)
    mixed = simplified_ranks([make(1.0), make(-1.0)])
    assert _ops(mixed[0]) == ["pow_scalar", "all_reduce", "pow_scalar", "pow_scalar"]


def test_a_root_of_a_value_that_may_be_negative_stays() -> None:
    x = torch.randn(4)
    graph = _captured(lambda t: (t.sum() ** (1 / 3)) ** 3, x)
    assert _ops(without_root_powers(graph)) == _ops(graph)


def test_zeros_added_to_a_broadcast_leave_the_broadcast() -> None:
    x = torch.randn(3)
    graph = _captured(lambda t: torch.zeros(2, 3) + t, x)
    simplified = without_zero_fills(graph)
    assert "add" not in _ops(simplified) and _same_numbers(graph, simplified, x)


def test_a_power_of_one_is_its_base() -> None:
    """The backward of `x ** 2` raises x to 1; a loss written as `mse_loss` does not."""
    x = torch.randn(4, 3)

    def gradient(t):
        t = t.requires_grad_()
        return torch.autograd.grad((t ** 2).sum(), t)[0]

    graph = capture(nn.Module(), lambda: gradient(x), {"x": x}, grad=True)
    simplified = without_unit_powers(graph)
    assert _ops(graph).count("pow_scalar") == 1 and "pow_scalar" not in _ops(simplified)
    assert _same_numbers(graph, simplified, x)


def test_picks_from_zeros_are_zeros() -> None:
    """DTensor's loss backward subtracts its pick from a zero fill: the subtraction goes."""
    ids = torch.randint(0, 5, (3,))
    graph = _captured(lambda t: torch.ones(3) - torch.zeros(3, 5)[torch.arange(3), t], ids)
    simplified = without_zero_fills(graph)
    assert "sub" not in _ops(simplified) and _same_numbers(graph, simplified, ids)


def _partition_written_back(x: torch.Tensor) -> torch.Tensor:
    """A flat buffer with one partition overwritten in place and read back (ZeRO's step on a
    rank's partition), and a read across the cut."""
    flat = torch.cat([x.reshape(-1), torch.zeros(2)])
    partitions = flat.narrow(0, 0, 7), flat.narrow(0, 7, 7)
    partitions[1].mul_(2)
    return torch.exp(partitions[1].clone()) + flat.narrow(0, 6, 7)


def test_a_slice_that_takes_one_operand_of_a_concat_is_that_operand() -> None:
    x = torch.randn(4, 3)
    graph = _captured(_partition_written_back, x)
    simplified = without_concat_picks(graph)
    exp = next(node for node in simplified if node.op == "exp")
    assert simplified[exp.inputs[0]].op == "mul_scalar"  # the partition written, read back
    assert _ops(simplified).count("slice") == _ops(graph).count("slice") - 1  # across: kept
    assert _same_numbers(graph, simplified, x)
