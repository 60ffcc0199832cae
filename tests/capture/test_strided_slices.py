"""Slices with a step (`x[::2]`, `x[..., 1::3]`, rotary's even and odd features) lower to data
movement, forward and backward, and compute what PyTorch computes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph

SLICES = [
    lambda x: x[::2],                # rows that fill whole pairs
    lambda x: x[1::2],
    lambda x: x[::3],                # a last row with no full triple after it
    lambda x: x[1:6:4],
    lambda x: x[:, ::2],
    lambda x: x[..., 1:7:2],
]


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 8, dtype=torch.float64))


@pytest.mark.parametrize("index", range(len(SLICES)))
def test_strided_slices_and_their_gradients_compute_what_torch_computes(index):
    cut = SLICES[index]
    module, x = Weighted(), torch.randn(7, 8, dtype=torch.float64)

    def step():
        value = cut(module.w * x).exp()
        return (value, *torch.autograd.grad(value.sum(), [module.w]))

    graph = capture(module, step, {"x": x}, grad=True)
    assert not [n for n in graph if n.op == "opaque"]
    values = run_graph(graph, {"w": module.w.detach(), "x": x})
    for name, expected in zip(graph.outputs, step()):
        assert torch.allclose(values[name], expected)
