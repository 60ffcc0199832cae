"""Every mutation operator plants a shape-valid change in a tiny two-rank graph."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from scalify.ir.distributed import merge_ranks
from scalify.ir.graph import Graph, Node
from scalify.ir.ops import infer_shape
from scalify.mutate.mutants import apply_change, mutants, type_checks
from scalify.mutate.operators import NUMBER_PRESERVING, OPERATORS, Change
from scalify.verify.numeric import random_inputs, run_graph

GROUP = (("group", (0, 1)),)


def _rank_graph() -> Graph:
    """x @ w, then one op of each kind the operators look for."""
    graph = Graph()

    def add(name: str, op: str, inputs: tuple[str, ...], attrs: tuple = (),
            shape: tuple[int, ...] | None = None) -> None:
        if shape is None:
            shape = infer_shape(op, [graph[i].shape for i in inputs], dict(attrs))
        graph.add(Node(name, op, inputs, attrs, shape, "float32"))

    add("x", "placeholder", (), (("shape", (4, 4)), ("target", "x")), (4, 4))
    add("w", "placeholder", (), (("shape", (4, 4)), ("target", "w")), (4, 4))
    add("mm", "matmul", ("x", "w"))
    add("ar", "all_reduce", ("mm",), GROUP + (("reduce", "sum"),), (4, 4))
    add("t", "transpose", ("ar",), (("dim0", 0), ("dim1", 1)))
    add("sm", "softmax", ("t",), (("dim", 1),))
    add("act", "gelu", ("sm",))
    add("scaled", "mul_scalar", ("act",), (("value", 0.5),))
    add("total", "add", ("scaled", "x"))
    add("diff", "sub", ("total", "x"))
    add("part", "slice", ("diff",), (("dim", 1), ("start", 1), ("end", 3)))
    add("ag", "all_gather", ("part",), GROUP + (("shape", (8, 2)),), (8, 2))
    add("rs", "reduce_scatter", ("ag",), GROUP + (("reduce", "sum"),), (4, 2))
    graph.outputs = ["rs"]
    return graph


@pytest.mark.parametrize("operator", list(OPERATORS))
def test_operator_plants_a_shape_valid_change(operator: str) -> None:
    ranks = [_rank_graph(), _rank_graph()]
    planted = mutants(ranks, operator, budget=100, seed=0)
    assert planted, f"{operator} found no site"
    for mutant in planted:
        assert len(mutant.ranks) == 2 and all(type_checks(g) for g in mutant.ranks)
        changed = [m.nodes != o.nodes or m.outputs != o.outputs
                   for o, m in zip(ranks, mutant.ranks)]
        assert all(changed) or (changed.count(True) == 1 and "only" in mutant.what)


@pytest.mark.parametrize("operator", NUMBER_PRESERVING)
def test_number_preserving_operator_keeps_every_output(operator: str) -> None:
    ranks = [_rank_graph(), _rank_graph()]
    original = merge_ranks(ranks)
    env = random_inputs(original.graph, seed=3)
    expected = run_graph(original.graph, env)
    planted = mutants(ranks, operator, budget=100, seed=0)
    assert planted
    for mutant in planted:
        mutated = merge_ranks(mutant.ranks)
        values = run_graph(mutated.graph, env)
        for before, after in zip(original.rank_outputs, mutated.rank_outputs):
            for a, b in zip(before, after):
                torch.testing.assert_close(values[b], expected[a], rtol=1e-12, atol=0)


def test_sampling_is_seeded_and_bounded() -> None:
    ranks = [_rank_graph(), _rank_graph()]
    first = [(m.node, m.what) for m in mutants(ranks, "sibling op", budget=2, seed=7)]
    again = [(m.node, m.what) for m in mutants(ranks, "sibling op", budget=2, seed=7)]
    assert first == again and len(first) == 2


def test_collectives_change_on_every_rank() -> None:
    ranks = [_rank_graph(), _rank_graph()]
    for mutant in mutants(ranks, "swap reduce op", budget=100, seed=0):
        assert all(g["ar"].attr("reduce") == "max" for g in mutant.ranks)


def test_a_change_that_breaks_shapes_is_skipped() -> None:
    ranks = [_rank_graph(), _rank_graph()]
    wider = Change("part", "slice widened",
                   lambda rank, node: [replace(node, attrs=(("dim", 1), ("start", 0), ("end", 3)))])
    assert apply_change(ranks, wider) is None  # its users expect two columns
    planted = mutants(ranks, "reduction dim", budget=100, seed=0)
    assert [m.what.startswith("softmax dim 1 -> 0") for m in planted] == [True]
