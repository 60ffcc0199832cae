"""An additive mask of zeros and -inf is a fill of -inf, and a safe softmax's test for rows
masked whole goes where no row is; a mask covering a row keeps the test. Each rewritten graph
computes what the captured one computes."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scalify.capture.tracer import capture
from scalify.ir.graph import Graph
from scalify.ir.masks import excluding_fills, masks_as_fills
from scalify.verify.numeric import run_graph


class _Attention(torch.nn.Module):
    def __init__(self, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def _graphs(mask: torch.Tensor | None) -> tuple[Graph, Graph, dict[str, torch.Tensor]]:
    inputs = {name: torch.randn(1, 2, 4, 3, dtype=torch.float64) for name in "qkv"}
    module = _Attention(mask)
    graph = capture(module, lambda: module(**inputs), inputs)
    return graph, masks_as_fills(graph), inputs


def _ops(graph: Graph) -> list[str]:
    return [node.op for node in graph]


def _guarded(graph: Graph) -> bool:
    """Whether a `where` chooses between a softmax and something else (the safe softmax)."""
    return any(node.op == "where" and any(graph[i].op == "softmax" for i in node.inputs)
               for node in graph)


def _output(graph: Graph, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return run_graph(graph, inputs)[graph.outputs[0]]


def test_a_causal_mask_is_a_fill_and_the_softmax_a_plain_one() -> None:
    captured, rewritten, inputs = _graphs(torch.ones(4, 4, dtype=torch.bool).tril())
    assert "masked_fill" in _ops(rewritten) and not _guarded(rewritten)
    assert _guarded(captured)
    assert torch.allclose(_output(rewritten, inputs), _output(captured, inputs))


def test_without_a_mask_the_softmax_is_a_plain_one() -> None:
    captured, rewritten, inputs = _graphs(None)
    assert not _guarded(rewritten) and "masked_fill" not in _ops(rewritten)
    assert torch.allclose(_output(rewritten, inputs), _output(captured, inputs))


def test_a_mask_covering_a_row_keeps_the_test() -> None:
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[2] = False  # row 2 attends nowhere: the safe softmax gives it zeros
    captured, rewritten, inputs = _graphs(mask)
    assert _guarded(rewritten)
    out = _output(rewritten, inputs)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    assert not math.isnan(out.sum().item())


class _Complement(torch.nn.Module):
    """Megatron's `1.0 - mask.float()` and nanotron's `(~mask).to(dtype)`, each scattered."""

    def __init__(self, written: str) -> None:
        super().__init__()
        self.written = written

    def forward(self, ids):
        mask = ids >= 3
        ones = 1.0 - mask.float() if self.written == "rsub" else (~mask).to(torch.float32)
        return ones * 2.0 + ones.exp()


def test_a_mask_complement_is_ones_filled_where_the_mask_is_on() -> None:
    for written in ("rsub", "not"):
        module, inputs = _Complement(written), {"ids": torch.randint(0, 6, (2, 5))}
        captured = capture(module, lambda: module(**inputs), inputs)
        rewritten = masks_as_fills(captured)
        fills = [node for node in rewritten if node.op == "masked_fill"]
        assert fills and all(rewritten[node.inputs[0]].op == "full" for node in fills), written
        assert rewritten[fills[0].inputs[1]].op == "ge_scalar", written  # the mask, not negated
        assert "rsub_scalar" not in _ops(rewritten) and "bitwise_not" not in _ops(rewritten)
        assert torch.equal(_output(rewritten, inputs), _output(captured, inputs)), written


class _LargeFill(torch.nn.Module):
    """Causal scores masked as Megatron masks them (`masked_fill(mask, -10000.0)`) or as
    HuggingFace does (the dtype's minimum added), then read by `reader`."""

    def __init__(self, written: str, reader=lambda s: torch.softmax(s, -1), covered_row=None):
        super().__init__()
        self.written, self.reader = written, reader
        self.masked = torch.ones(4, 4, dtype=torch.bool).triu(1)
        if covered_row is not None:
            self.masked[covered_row] = True

    def forward(self, q):
        scores = q @ q.transpose(-1, -2)
        if self.written == "fill":
            scores = scores.masked_fill(self.masked, -10000.0)
        else:
            scores = scores + torch.zeros(4, 4).masked_fill(self.masked, torch.finfo(torch.float32).min)
        return self.reader(scores)


def _large_fill(module: torch.nn.Module) -> tuple[Graph, Graph, dict[str, torch.Tensor]]:
    inputs = {"q": torch.randn(2, 4, 3)}
    graph = capture(module, lambda: module(**inputs), inputs)
    return graph, masks_as_fills(graph), inputs


def _fills(graph: Graph) -> list[float]:
    """The fills of the scores (not of the constant the added mask is built from)."""
    return [node.attr("value") for node in graph
            if node.op == "masked_fill" and graph[node.inputs[0]].op != "full"]


def test_a_large_negative_fill_before_a_softmax_is_a_fill_of_minus_infinity() -> None:
    for written in ("fill", "added minimum"):
        captured, rewritten, inputs = _large_fill(_LargeFill(written))
        assert _fills(rewritten) == [-math.inf], written
        assert excluding_fills(captured, rewritten), written  # stated as an assumption
        before, after = _output(captured, inputs), _output(rewritten, inputs)
        assert torch.allclose(after.double(), before.double()), written
        assert not before[..., _LargeFill(written).masked].any(), written  # weighed 0 as written


def test_a_large_negative_fill_stays_where_it_is_not_only_a_softmax_weight() -> None:
    kept = {"log_softmax": _LargeFill("fill", lambda s: torch.log_softmax(s, -1)),
            "also an output": _LargeFill("fill", lambda s: (torch.softmax(s, -1), s)),
            "softmax over another dim": _LargeFill("fill", lambda s: torch.softmax(s, -2)),
            "a row masked whole": _LargeFill("fill", covered_row=1)}
    for why, module in kept.items():
        captured, rewritten, _ = _large_fill(module)
        assert _fills(rewritten) == [-10000.0] and not excluding_fills(captured, rewritten), why


class _CastThenBroadcast(torch.nn.Module):
    """torchtitan's vocab-parallel embedding: the lookup times its in-range mask, cast to numbers
    and then broadcast to the lookup's rows; its ids clamped into the table's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

    def forward(self, ids):
        mask = (ids >= 2) & (ids < 6)
        out = F.embedding((ids - 2).clamp(0, 3), self.weight)
        return out * mask.unsqueeze(-1).to(out.dtype)


def test_a_mask_cast_then_broadcast_is_a_fill_and_an_integer_clamp_its_fills() -> None:
    module, inputs = _CastThenBroadcast(), {"ids": torch.randint(0, 8, (2, 5))}
    captured = capture(module, lambda: module(**inputs), inputs)
    rewritten = masks_as_fills(captured)
    assert "mul" not in _ops(rewritten) and "where" not in _ops(rewritten)
    assert _ops(rewritten).count("masked_fill") == 3  # the clamp's two and the lookup's zeros
    values = {**inputs, "weight": module.weight.detach()}
    assert torch.equal(_output(rewritten, values), _output(captured, values))
    assert torch.equal(_output(captured, values), module(**inputs).detach())
