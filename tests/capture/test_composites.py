"""Ops without a lowering of their own capture through PyTorch's decompositions or the composite
lowerings, and the captured graph computes what PyTorch computes (run by the IR interpreter)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph

CASES = {
    "max along a dim": lambda x: x.max(dim=1),
    "min keepdim": lambda x: x.min(dim=0, keepdim=True),
    "argmax": lambda x: x.argmax(-1),
    "argmin of all": lambda x: x.argmin(),
    "amin": lambda x: x.amin((0, 1)),
    "mv": lambda x: torch.mv(x, x[0]),
    "roll": lambda x: torch.roll(x, (1, -2), (0, 1)),
    "roll flat": lambda x: torch.roll(x, 5),
    "pow with a scalar base": lambda x: torch.pow(2.0, x),
    "einsum": lambda x: torch.einsum("ij,kj->ik", x, x),
    "baddbmm beta=0": lambda x: torch.baddbmm(x[None, :, :4], x[None], x.t()[None, :, :4],
                                              beta=0, alpha=0.5),
    "baddbmm beta=1": lambda x: torch.baddbmm(x[None, :, :4], x[None], x.t()[None, :, :4]),
    "addmm with beta and alpha": lambda x: torch.addmm(x[:, :4], x, x.t()[:, :4], beta=0.5, alpha=2),
    "chunk": lambda x: torch.cat(list(x.chunk(3, 1))[::-1], 1),
    "split": lambda x: x.split([1, 3], 0)[1],
    "narrow": lambda x: x.narrow(1, 1, 2),
    "as_strided rows": lambda x: x.as_strided((4, 3), (6, 2), 1),
    "as_strided of a transpose": lambda x: x.t().as_strided((3, 4), (1, 6), 0),
    "empty then copy_": lambda x: torch.empty(4, 6, dtype=x.dtype).copy_(x) * 2,
    "resize_ then copy_": lambda x: x.new_empty(0).resize_(4, 6).copy_(x) + 1,
    "resize_ to its own shape": lambda x: (x * 2).resize_(4, 6),
    "new_empty then fill_": lambda x: x.new_empty(6).fill_(2.0) + x[0],
    "masked_fill with a 0-dim tensor": lambda x: x.masked_fill(x > 0, torch.tensor(1.5)),
    "index_select": lambda x: x.index_select(1, torch.tensor([2, 0, 5])),
    "flip": lambda x: x.flip(0, 1),
    "repeat": lambda x: x.repeat(2, 1, 3),
    "tan, expm1, log1p, sign": lambda x: x.tan() + x.expm1() + x.abs().log1p() + x.sign(),
    "floor division": lambda x: torch.div(x, 0.3, rounding_mode="floor"),
    "tril": lambda x: x.tril(),
    "triu": lambda x: x.triu(1),
    "cumsum": lambda x: x.cumsum(0),
    "var_mean over two dims": lambda x: torch.var_mean(x, dim=(0, 1)),
    "layer_norm over two dims": lambda x: F.layer_norm(x, (4, 6)),
    "_safe_softmax": lambda x: torch.ops.aten._safe_softmax(x, -1),
    "attention with a boolean mask": lambda x: F.scaled_dot_product_attention(
        x[None], x[None], x[None], attn_mask=torch.ones(4, 4, dtype=torch.bool).tril()),
    "causal attention": lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None],
                                                                 is_causal=True),
    "clamp": lambda x: x.clamp(-0.5, 0.5),
    "where with a scalar": lambda x: torch.where(x > 0, x, 0.0),
    "one pick per row by indexing": lambda x: x[torch.arange(4), torch.tensor([5, 0, 3, 1])],
    "one value put per row": lambda x: _put(x, x[:, 2], accumulate=False),
    "one value added per row": lambda x: _put(x, x[:, 2], accumulate=True),
    "one row value less a mask": lambda x: _put(x, 1.0 - (x[:, 0] > 0).to(x.dtype), subtract=True),
    # PyTorch's optimizers and gradient clipping on a GPU: one op over a list of tensors
    "foreach norm": lambda x: tuple(torch._foreach_norm([x, x[1:]], 2)),
    "foreach mul_ by a tensor": lambda x: _foreach_in_place(x, lambda ts: torch._foreach_mul_(
        ts, x.abs().sum())),
    "foreach add_ of a list with alpha": lambda x: _foreach_in_place(x, lambda ts: torch._foreach_add_(
        ts, [x.exp(), x.sin()], alpha=-0.1)),
    "foreach addcdiv_ with scalars": lambda x: _foreach_in_place(x, lambda ts: torch._foreach_addcdiv_(
        ts, [x, x], [x.abs() + 1, x.abs() + 2], [0.5, -2.0])),
    "foreach lerp and sqrt": lambda x: tuple(torch._foreach_sqrt(torch._foreach_lerp(
        [x.abs(), x.abs() + 1], [x.abs() + 2, x.abs()], 0.3))),
}


def _foreach_in_place(x, update):
    """`update` applied in place to two tensors made from `x`; both returned."""
    tensors = [x * 2, x + 1]
    update(tensors)
    return tuple(tensors)


def _put(x, values, accumulate=False, subtract=False):
    """`x[arange, ids] = v`, `+= v` or `-= v` on a copy (cross-entropy's hand-written backward)."""
    y, rows, ids = x.clone(), torch.arange(4), torch.tensor([5, 0, 3, 1])
    if subtract:
        y[rows, ids] -= values
    elif accumulate:
        y[rows, ids] += values
    else:
        y[rows, ids] = values
    return y


@pytest.mark.parametrize("name", CASES)
def test_captured_graph_computes_what_torch_computes(name):
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = CASES[name](x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    graph = capture(nn.Module(), lambda: CASES[name](x), {"x": x})
    assert not [n for n in graph if n.op == "opaque"]
    values = run_graph(graph, {"x": x})
    for output, want in zip(graph.outputs, expected):
        assert torch.allclose(values[output], want.to(values[output].dtype)), name


def test_an_op_without_any_lowering_is_kept_opaque():
    x = torch.empty(4, 4, device="meta")
    graph = capture(nn.Module(), lambda: torch.linalg.qr(x)[0], {"x": x})
    (node, *_) = [n for n in graph if n.op == "opaque"]
    assert node.attr("target") == "aten.linalg_qr" and node.shape == (4, 4)
    assert node.source.file == __file__


def test_one_pick_per_row_by_indexing_is_a_take():
    x = torch.empty(4, 6, device="meta")
    ids = torch.empty(4, dtype=torch.long, device="meta")
    graph = capture(nn.Module(), lambda: x[torch.arange(4), ids], {"x": x, "ids": ids})
    assert [n.op for n in graph if n.op in ("take", "index")] == ["take"]


def test_uninitialised_memory_read_is_a_draw_of_its_own():
    x = torch.empty(4, device="meta")
    graph = capture(nn.Module(), lambda: torch.empty(4, device="meta") + x, {"x": x})
    assert [n.op for n in graph if n.op not in ("placeholder", "add")] == ["uninitialized"]


def test_one_value_put_per_row_is_an_untake():
    x = torch.empty(4, 6, device="meta")
    ids = torch.empty(4, dtype=torch.long, device="meta")

    def put():
        y = x.clone()
        y[torch.arange(4), ids] -= 1.0
        return y
    graph = capture(nn.Module(), put, {"x": x, "ids": ids})
    assert "untake" in {n.op for n in graph} and "opaque" not in {n.op for n in graph}
