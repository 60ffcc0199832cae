"""Uninterpreted ops and random draws in verification: the same convolution on the reference
and the ranks matches, another does not; random draws are never proven equal, so a reference
and ranks that both draw are unknown, never verified; a value read into Python is refused."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify
from scalify.capture.tracer import capture
from scalify.errors import CaptureError
from scalify.verify.numeric import run_graph

HIDDEN, FFN, WORLD = 16, 16, 2


class ConvMLP(nn.Module):
    """A convolution (replicated), then an MLP (column- then row-parallel on the ranks)."""

    def __init__(self, ffn: int = FFN, flipped: bool = False, noise: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1, bias=False)
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.flipped, self.noise = flipped, noise

    def forward(self, x):
        weight = self.conv.weight.flip(-1) if self.flipped else self.conv.weight
        hidden = self.up(F.conv2d(x, weight, padding=1).flatten(1))
        if self.noise:
            hidden = hidden + torch.rand(hidden.shape, device=hidden.device)
        return self.down(hidden)


class ParallelConvMLP(ConvMLP):
    def forward(self, x):
        return funcol.all_reduce(super().forward(x), "sum", dist.group.WORLD)


def _verify(reference: ConvMLP, **rank_options):
    return scalify.verify_modules(
        reference.to("meta"),
        lambda rank: ParallelConvMLP(FFN // WORLD, **rank_options).to("meta"), WORLD,
        {"x": torch.empty(2, 1, 4, 4, device="meta")},
        {"up.weight": scalify.Shard(0), "down.weight": scalify.Shard(1)})


def test_the_same_convolution_on_reference_and_ranks_verifies():
    assert _verify(ConvMLP()).verified


def test_another_convolution_on_the_ranks_is_a_discrepancy():
    report = _verify(ConvMLP(), flipped=True)
    assert not report.verified and report.verdict == "discrepancy"


def test_random_draws_on_reference_and_ranks_are_unknown_not_verified():
    report = _verify(ConvMLP(noise=True), noise=True)
    assert not report.verified and report.verdict == "unknown"
    assert any("aten.rand at" in reason and "random draw" in reason for reason in report.unknown)


def test_a_random_draw_on_the_ranks_only_is_not_verified():
    assert not _verify(ConvMLP(), noise=True).verified


def test_two_identical_draws_are_two_values():
    graph = capture(nn.Module(), lambda: (torch.rand(3), torch.rand(3)), {})
    first, second = (graph[name] for name in graph.outputs)
    assert first.op == second.op == "rand" and first.attr("draw") != second.attr("draw")


def test_reading_a_computed_value_into_python_is_refused():
    x = torch.ones(3)
    with pytest.raises(CaptureError, match="read into Python"):
        capture(nn.Module(), lambda: x * (x.sum().item()), {"x": x})


@pytest.mark.parametrize("read", [lambda t: t.tolist(), lambda t: t.numpy()])
def test_reading_a_computed_value_as_a_list_is_refused(read):
    x = torch.ones(3)
    with pytest.raises(CaptureError, match="read into Python"):
        capture(nn.Module(), lambda: x * read(x.view(3, 1).sum(1))[0], {"x": x})


def test_reading_a_random_draw_into_python_is_refused():
    with pytest.raises(CaptureError, match="read into Python"):
        capture(nn.Module(), lambda: torch.ones(2) * torch.rand(()).item(), {})


def test_reading_a_constant_into_python_is_allowed():
    x = torch.ones(3)
    graph = capture(nn.Module(), lambda: x * torch.tensor([2.0, 3.0]).sum().item(), {"x": x})
    assert [n.attr("value") for n in graph if n.op == "mul_scalar"] == [5.0]
    graph = capture(nn.Module(), lambda: x * torch.tensor([2.0, 3.0]).tolist()[1], {"x": x})
    assert [n.attr("value") for n in graph if n.op == "mul_scalar"] == [3.0]
    # an op kept opaque (nonzero) on constants, as DeviceMesh slicing does: a constant too
    graph = capture(nn.Module(), lambda: x * torch.tensor([0, 0, 2]).nonzero()[0, 0].item(),
                    {"x": x})
    assert [n.attr("value") for n in graph if n.op == "mul_scalar"] == [2.0]


def test_one_hot_of_computed_labels_is_captured_not_refused():
    """PyTorch's eager one_hot reads the labels' range into Python; captured, it compares."""
    x = torch.tensor([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1]])
    program = lambda: F.one_hot(x.argmax(dim=1), 3) * x  # noqa: E731
    graph = capture(nn.Module(), program, {"x": x})
    assert torch.equal(run_graph(graph, {"x": x})[graph.outputs[0]], program())
