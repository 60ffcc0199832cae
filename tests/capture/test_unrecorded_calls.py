"""What reaches a tensor without an op the recorder records: `.data` swaps, bookkeeping on
values from outside the program, empty parts, and scalars added at float32 precision."""
import struct

import torch
from torch import nn
import torch.nn.functional as F

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph

X = {"x": torch.randn(3, 4)}


def _captured(module: nn.Module):
    graph = capture(module, lambda: module(**X), X)
    return graph, run_graph(graph, X)[graph.outputs[0]]


class ViewlessCopy(nn.Module):
    """Megatron's make_viewless_tensor: a fresh tensor whose data is swapped for its input's."""

    def forward(self, x):
        out = torch.empty((1,), dtype=x.dtype, device=x.device)
        out.data = (x * 2).data
        return out + 1


def test_a_data_swap_passes_the_value_on():
    graph, value = _captured(ViewlessCopy())
    assert "uninitialized" not in {node.op for node in graph}
    torch.testing.assert_close(value, X["x"] * 2 + 1)


class StateCheck(nn.Module):
    """Megatron's RNG fork: compares CPU generator states, values the program never computes."""

    def forward(self, x):
        state = torch.get_rng_state()
        if not torch.all(state == torch.get_rng_state()).item():
            raise RuntimeError("the CPU generator moved")
        return x * 3


def test_bookkeeping_on_values_from_outside_runs_unrecorded():
    graph, value = _captured(StateCheck())
    assert [node.op for node in graph if node.op != "placeholder"] == ["mul_scalar"]
    torch.testing.assert_close(value, X["x"] * 3)


class EmptyPassThrough(nn.Module):
    """Megatron's rotary embedding over every dim: the pass-through part is empty."""

    def forward(self, x):
        rotated, passed = x[..., :4], x[..., 4:]
        return torch.cat((rotated * 2, passed), dim=-1)


def test_an_empty_part_adds_nothing():
    graph, value = _captured(EmptyPassThrough())
    assert "opaque" not in {node.op for node in graph}
    torch.testing.assert_close(value, X["x"] * 2)


class Epsilon(nn.Module):
    def forward(self, x):
        return x + 1e-5


def test_a_scalar_added_to_float32_is_held_at_float32():
    graph, _ = _captured(Epsilon())
    [added] = [node for node in graph if node.op == "add_scalar"]
    assert added.attr("value") == struct.unpack("f", struct.pack("f", 1e-5))[0] != 1e-5


class _MaskedByRealIds(nn.Module):
    """torchtitan's vocab-parallel embedding: a meta lookup times a mask of the real ids."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(8, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids < 5
        return F.embedding(ids, self.weight) * mask.unsqueeze(-1).to(torch.float32)


def test_an_op_mixing_meta_and_real_tensors_is_recorded():
    module, ids = _MaskedByRealIds(), torch.randint(0, 8, (2, 3))
    graph = capture(module, lambda: module(ids), {"ids": ids})
    assert [n.op for n in graph if n.op == "mul"] == ["mul"]


class _ScaleUnderRealMask(nn.Module):
    """A 0-dim meta parameter chosen by a mask of real ids (torchtitan's loss backward picks its
    0-dim gradient where the labels are not ignored): the op runs on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, ids):
        return torch.where(ids != 3, self.scale, 0.0)


def test_a_0_dim_meta_tensor_under_a_real_mask_runs_on_meta():
    module, ids = _ScaleUnderRealMask().to("meta"), torch.randint(0, 8, (2, 3))
    graph = capture(module, lambda: module(ids), {"ids": ids})
    assert [n.op for n in graph if n.op == "masked_fill"] == ["masked_fill"]
