"""An additive mask of zeros and -inf is a fill of -inf, and a safe softmax's test for rows
masked whole goes where no row is; a mask covering a row keeps the test. Each rewritten graph
computes what the captured one computes."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scalify.capture.tracer import capture
from scalify.ir.graph import Graph
from scalify.ir.masks import masks_as_fills
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
