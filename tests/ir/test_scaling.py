"""Scalar factors are carried to the op that needs them, so the same math scaled elsewhere is the
same graph; the moved graph computes what the original computes."""
from __future__ import annotations

import pytest
import torch

from scalify.capture.builder import GraphBuilder
from scalify.capture.tracer import capture
from scalify.ir.graph import Graph
from scalify.ir.scaling import pushed_scales
from scalify.models import build_reference, example_inputs, make_hf_config
from scalify.models.presets import PRESETS
from scalify.steps import Step, hf_loss, training_step
from scalify.verify.numeric import random_inputs, run_graph


def _mean_then_average(rows: int, world: int, group: tuple[int, ...] = (0, 1)) -> Graph:
    """A rank's data-parallel loss: the mean of its rows, summed over ranks, divided by the world."""
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (rows, 4), "float32")
    total = b.emit("sum", [b.emit("merge", [x], dim=0, inner=4)], dim=0)
    local_mean = b.emit("div_scalar", [total], value=float(rows * 4))
    summed = b.emit("all_reduce", [local_mean], reduce="sum", group=group)
    b.graph.outputs = [b.emit("mul_scalar", [summed], value=1.0 / world).name]
    return b.graph


def _output(graph: Graph):
    return graph[graph.outputs[0]]


def test_factors_meet_after_the_collective() -> None:
    pushed = pushed_scales([_mean_then_average(2, 2), _mean_then_average(2, 2)])
    for graph in pushed:
        out = _output(graph)
        assert (out.op, out.attr("value")) == ("mul_scalar", 1 / 16)
        assert graph[out.inputs[0]].op == "all_reduce"
        assert graph[graph[out.inputs[0]].inputs[0]].op == "sum"  # no scaling before the sum


def test_the_reference_mean_gets_the_same_node() -> None:
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (4, 4), "float32")
    total = b.emit("sum", [b.emit("merge", [x], dim=0, inner=4)], dim=0)
    b.graph.outputs = [b.emit("mul_scalar", [total], value=0.0625).name]
    out = _output(pushed_scales([b.graph])[0])
    assert (out.op, out.attr("value")) == ("mul_scalar", 1 / 16)


def test_members_with_other_factors_write_them_before_the_collective() -> None:
    pushed = pushed_scales([_mean_then_average(2, 2), _mean_then_average(4, 2)])
    for graph, rows in zip(pushed, (2, 4)):
        reduce = next(node for node in graph if node.op == "all_reduce")
        scaled = graph[reduce.inputs[0]]
        assert (scaled.op, scaled.attr("value")) == ("mul_scalar", 1 / (rows * 4))
        assert _output(graph).attr("value") == 0.5


def test_a_nonlinear_op_reads_the_scaled_value() -> None:
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 3), "float32")
    w = b.emit_placeholder("w", "parameter", (3, 3), "float32")
    scores = b.emit("matmul", [b.emit("mul_scalar", [x], value=0.5), w])
    b.graph.outputs = [b.emit("exp", [scores]).name]
    graph = pushed_scales([b.graph])[0]
    scaled = graph[_output(graph).inputs[0]]
    assert (scaled.op, scaled.attr("value")) == ("mul_scalar", 0.5)
    assert graph[scaled.inputs[0]].op == "matmul" and graph[scaled.inputs[0]].inputs == ("x", "w")


def _query_key_scores(fill=None) -> Graph:
    """Attention's scores as PyTorch's attention writes them: the query and the key each
    scaled by the square root of 1/2, then (optionally) filled where a mask says, then exp."""
    b = GraphBuilder()
    root = 0.5 ** 0.5
    q = b.emit("mul_scalar", [b.emit_placeholder("q", "input", (2, 3), "float32")], value=root)
    k = b.emit("mul_scalar", [b.emit_placeholder("k", "input", (3, 2), "float32")], value=root)
    scores = b.emit("matmul", [q, k])
    if fill is not None:
        mask = b.emit_placeholder("m", "input", (2, 2), "bool")
        scores = b.emit("masked_fill", [scores, mask], value=fill)
    b.graph.outputs = [b.emit("exp", [scores]).name]
    return b.graph


def test_a_scale_split_as_square_roots_of_a_product_is_the_scale() -> None:
    graph = pushed_scales([_query_key_scores()])[0]
    scaled = graph[_output(graph).inputs[0]]
    assert (scaled.op, scaled.attr("value")) == ("mul_scalar", 0.5)


def test_a_fill_of_minus_infinity_passes_a_positive_factor_and_keeps_another() -> None:
    graph = pushed_scales([_query_key_scores(float("-inf"))])[0]
    scaled = graph[_output(graph).inputs[0]]
    assert (scaled.op, scaled.attr("value")) == ("mul_scalar", 0.5)
    assert graph[scaled.inputs[0]].op == "masked_fill"
    filled = pushed_scales([_query_key_scores(1.0)])[0]
    assert filled[_output(filled).inputs[0]].op == "masked_fill"  # 1.0 does not scale


def test_a_product_with_a_uniform_constant_is_a_factor() -> None:
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 3), "float32")
    third = b.emit("full", [], shape=(2, 3), value=1 / 3, dtype="float32")
    b.graph.outputs = [b.emit("tanh", [b.emit("mul", [x, third])]).name]
    graph = pushed_scales([b.graph])[0]
    scaled = graph[_output(graph).inputs[0]]
    assert (scaled.op, scaled.inputs) == ("mul_scalar", ("x",))
    assert scaled.attr("value") == float(torch.tensor(1 / 3, dtype=torch.float32).item())


def test_a_sum_of_terms_scaled_apart_carries_the_first_ones_factor() -> None:
    """`x/8 - mean(x/8)`: the 1/8 passes on, the mean's own 1/4 is written as its ratio."""
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 4), "float32")
    scaled = b.emit("mul_scalar", [x], value=0.125)
    mean = b.emit("mul_scalar", [b.emit("expand", [b.emit("sum", [scaled], dim=1)], dim=1, size=4)],
                  value=0.25)
    b.graph.outputs = [b.emit("sub", [scaled, mean]).name]
    graph = pushed_scales([b.graph])[0]
    out = _output(graph)
    assert (out.op, out.attr("value")) == ("mul_scalar", 0.125)
    difference = graph[out.inputs[0]]
    assert difference.op == "sub" and graph[difference.inputs[1]].attr("value") == 0.25


def _bucket(world: int) -> Graph:
    """Two gradients scaled apart, flattened into one bucket, summed over ranks, split back."""
    b = GraphBuilder()
    weight = b.emit("mul_scalar", [b.emit_placeholder("w", "input", (4,), "float32")], value=0.5)
    bias = b.emit("mul_scalar", [b.emit_placeholder("b", "input", (2,), "float32")], value=0.25)
    summed = b.emit("all_reduce", [b.concat([weight, bias], 0)], reduce="sum",
                    group=tuple(range(world)))
    b.graph.outputs = [b.emit("slice", [summed], dim=0, start=0, end=4).name,
                       b.emit("slice", [summed], dim=0, start=4, end=6).name]
    return b.graph


def test_each_part_of_a_bucket_keeps_its_factor() -> None:
    for graph in pushed_scales([_bucket(2), _bucket(2)]):
        factors = [graph[name].attr("value") for name in graph.outputs]
        assert factors == [0.5, 0.25]
        bucket = next(node for node in graph if node.op == "concat")
        assert bucket.inputs == ("w", "b")  # (no factor inside the bucket)


def _fused_pieces(factors: tuple[float, ...], outer: float) -> Graph:
    """Fused q, k and v gradient pieces scaled apart, joined, merged across the join and summed
    (a weight gradient), then scaled by `outer` (a data-parallel average)."""
    b = GraphBuilder()
    pieces = [b.emit("mul_scalar", [b.emit_placeholder(name, "input", (3, 2), "float32")],
                     value=value) for name, value in zip("qkv", factors)]
    rows = b.emit("merge", [b.concat(pieces, 1)], dim=0, inner=6)
    summed = b.emit("sum", [rows], dim=0)
    b.graph.outputs = [b.emit("mul_scalar", [summed], value=outer).name]
    return b.graph


def test_a_bucket_entering_another_op_carries_its_first_parts_factor() -> None:
    """The pieces' first factor passes on and meets one applied after: pieces scaled
    1/4 : 1/4 : 1/2 then averaged over two ranks, and 1/8 : 1/8 : 1/4 not averaged, give the same
    nodes (the v piece's ratio 2 inside, 1/8 at the output) and the numbers they had."""
    averaged, whole = _fused_pieces((0.25, 0.25, 0.5), 0.5), _fused_pieces((0.125, 0.125, 0.25), 1)
    pushed = pushed_scales([averaged, whole])
    for graph in pushed:
        out = _output(graph)
        assert (out.op, out.attr("value")) == ("mul_scalar", 0.125)
        assert sorted(n.attr("value") for n in graph if n.op == "mul_scalar") == [0.125, 2.0]
    env = {name: torch.randn(3, 2, dtype=torch.float64) for name in "qkv"}
    for original, graph in zip((averaged, whole), pushed):
        before, after = run_graph(original, env), run_graph(graph, env)
        torch.testing.assert_close(after[graph.outputs[0]], before[original.outputs[0]])


def _padded_bucket() -> Graph:
    """ZeRO's flat bucket: a gradient and zero padding end to end, reduced in two partitions
    that cut across the gradient, joined again and the gradient taken back."""
    b = GraphBuilder()
    weight = b.emit("mul_scalar", [b.emit_placeholder("w", "input", (5,), "float32")], value=0.5)
    pad = b.emit("slice", [b.emit("full", [], shape=(8,), value=0.0, dtype="float32")], dim=0,
                 start=0, end=3)
    bucket = b.concat([weight, pad], 0)
    halves = [b.emit("all_reduce", [b.emit("slice", [bucket], dim=0, start=start, end=start + 4)],
                     reduce="sum", group=(0, 1)) for start in (0, 4)]
    b.graph.outputs = [b.emit("slice", [b.concat(halves, 0)], dim=0, start=0, end=5).name]
    return b.graph


def test_a_bucket_padded_with_zeros_and_cut_across_its_parts_carries_their_factor() -> None:
    for graph in pushed_scales([_padded_bucket(), _padded_bucket()]):
        out = _output(graph)
        assert (out.op, out.attr("value")) == ("mul_scalar", 0.5)
        assert [node.name for node in graph if node.op == "mul_scalar"] == [out.name]


def test_a_uniform_constant_is_ones_times_its_value() -> None:
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 3), "float32")
    half = b.emit("full", [], shape=(2, 3), value=0.5, dtype="float32")
    b.graph.outputs = [b.emit("add", [b.emit("mul_scalar", [x], value=0.5), half]).name]
    graph = pushed_scales([b.graph])[0]
    out = _output(graph)
    assert (out.op, out.attr("value")) == ("mul_scalar", 0.5)
    total = graph[out.inputs[0]]
    assert total.inputs[0] == "x" and graph[total.inputs[1]].attr("value") == 1.0


def _negated_twelfth(order: str) -> Graph:
    """x / 12 negated before the scaling, after it, or as a product with -1/12."""
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 3), "float32")
    if order == "before":
        value = b.emit("div_scalar", [b.emit("neg", [x])], value=12.0)
    elif order == "after":
        value = b.emit("neg", [b.emit("div_scalar", [x], value=12.0)])
    else:
        value = b.emit("mul", [x, b.emit("full", [], shape=(2, 3), value=-1 / 12, dtype="float32")])
    b.graph.outputs = [b.emit("tanh", [value]).name]
    return b.graph


def test_a_negative_factor_carries_its_size_and_leaves_its_sign() -> None:
    """However the code negates, the factor carried is 1/12 and a negation of x remains."""
    for order in ("before", "after", "product"):
        graph = pushed_scales([_negated_twelfth(order)])[0]
        scaled = graph[_output(graph).inputs[0]]
        assert scaled.op == "mul_scalar" and scaled.attr("value") == pytest.approx(1 / 12), order
        negated = graph[scaled.inputs[0]]
        assert (negated.op, negated.inputs) == ("neg", ("x",)), order
        env, written = {"x": torch.randn(2, 3)}, _negated_twelfth(order)
        torch.testing.assert_close(run_graph(graph, env)[graph.outputs[0]],
                                   run_graph(written, env)[written.outputs[0]], check_dtype=False)


def test_a_negative_uniform_constant_is_minus_ones_times_its_size() -> None:
    b = GraphBuilder()
    x = b.emit_placeholder("x", "input", (2, 3), "float32")
    b.graph.outputs = [b.emit("add", [b.emit("mul_scalar", [x], value=-0.5),
                                      b.emit("full", [], shape=(2, 3), value=-0.5,
                                             dtype="float32")]).name]
    graph = pushed_scales([b.graph])[0]
    out = _output(graph)
    assert (out.op, out.attr("value")) == ("mul_scalar", 0.5)
    total = graph[out.inputs[0]]
    assert graph[total.inputs[0]].op == "neg" and graph[total.inputs[1]].attr("value") == -1.0


def test_integer_values_keep_their_scalars() -> None:
    b = GraphBuilder()
    ids = b.emit_placeholder("ids", "input", (4,), "int64")
    b.graph.outputs = [b.emit("mul_scalar", [ids], value=2).name]
    graph = pushed_scales([b.graph])[0]
    assert _output(graph).op == "mul_scalar" and _output(graph).inputs == ("ids",)


def test_a_captured_training_step_computes_the_same_numbers() -> None:
    config = make_hf_config("llama", {**PRESETS["llama-tiny"].config, "num_hidden_layers": 1})
    model = build_reference("llama", config)
    names = [name for name, _ in model.named_parameters()]
    inputs = example_inputs("llama", 2, 8)
    inputs["labels"] = inputs["input_ids"].clone()
    step = Step(model, training_step(hf_loss, names))
    graph = capture(step, lambda: step(**inputs), inputs, grad=True)
    pushed = pushed_scales([graph])[0]
    assert sum(n.op in ("mul_scalar", "div_scalar") for n in pushed) < sum(
        n.op in ("mul_scalar", "div_scalar") for n in graph)
    env = {name: value.double() if value.is_floating_point() else value
           for name, value in random_inputs(graph).items()}
    before, after = run_graph(graph, env), run_graph(pushed, env)
    for old, new in zip(graph.outputs, pushed.outputs):
        torch.testing.assert_close(after[new], before[old])
