"""Lines that pass a value on unchanged (a return, an identity Function, a buffer a collective
writes into) ride on the node holding the value, and a discrepancy names them: the bug is often
the line that returned a partial sum, not the op that computed it."""
import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify
from scalify import Replicate, Shard
from scalify.capture.tracer import capture
from scalify.report.render import to_html

from ..verify.test_verify_modules import FFN, HIDDEN, MLP, WORLD

TOKENS = 4


def _line_of(function, text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def doubled(x):
    y = x * 2
    return y


def doubled_twice_removed(x):
    z = doubled(x)
    return z


def test_a_value_returned_through_two_functions_names_each_return_and_call():
    x = torch.randn(3)
    graph = capture(nn.Module(), lambda: doubled_twice_removed(x), {"x": x})
    (node,) = [n for n in graph if n.op == "mul_scalar"]
    here = __file__
    assert node.source.passed_at[:3] == (
        f"{here}:{_line_of(doubled, 'return y')}",
        f"{here}:{_line_of(doubled_twice_removed, 'z = doubled')}",
        f"{here}:{_line_of(doubled_twice_removed, 'return z')}")


def test_a_debuggers_trace_function_is_left_in_place():
    def tracer(frame, event, arg):
        return None

    x = torch.randn(3)
    sys.settrace(tracer)
    try:
        capture(nn.Module(), lambda: doubled(x), {"x": x})
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


class RowParallelDown(nn.Linear):
    """Forgets its all-reduce: returns the rank's partial sum."""

    def forward(self, x):
        partial = F.linear(x, self.weight)
        return partial


class _Identity(torch.autograd.Function):
    """Copied from the column-parallel input region where the reduction belonged."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class IdentityForReduce(MLP):
    def forward(self, x):
        partial = self.down(F.gelu(self.up(x)))
        out = _Identity.apply(partial)
        return out


def _row_parallel_rank(rank: int) -> nn.Module:
    mlp = MLP(FFN // WORLD).to("meta")
    mlp.down = RowParallelDown(FFN // WORLD, HIDDEN, bias=False, device="meta")
    return mlp


def _verify(rank_module_factory) -> scalify.Report:
    return scalify.verify_modules(
        reference=MLP(), rank_module_factory=rank_module_factory, world_size=WORLD,
        example_inputs={"x": torch.randn(TOKENS, HIDDEN)},
        param_placements={"up.weight": Shard(0), "down.weight": Shard(1)},
        output_placements=[Replicate()])


def test_a_layer_returning_its_partial_sum_is_named_at_its_return(tmp_path):
    report = _verify(_row_parallel_rank)
    assert report.verdict == "discrepancy"
    line = _line_of(RowParallelDown.forward, "return partial")
    assert (__file__, line) in report.discrepancies[0].lines()
    to_html(report, tmp_path / "report.html")  # the report shows where it was passed on
    assert f"passed on at {__file__}:{line}" in (tmp_path / "report.html").read_text()


def test_an_identity_function_in_place_of_the_reduction_is_named_where_it_is_applied():
    report = _verify(lambda rank: IdentityForReduce(FFN // WORLD).to("meta"))
    assert report.verdict == "discrepancy"
    line = _line_of(IdentityForReduce.forward, "_Identity.apply")
    assert (__file__, line) in report.discrepancies[0].lines()


class GatheredMLP(nn.Module):
    """Column-parallel up projection gathered into a preallocated buffer (its blocks cut in the
    wrong order when `reversed`), then the full down projection."""

    def __init__(self, ffn: int, reverse: bool) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.reverse = reverse

    def forward(self, x):
        local = self.up(x)
        out = torch.empty(TOKENS, FFN, device=x.device)
        blocks = list(out.chunk(WORLD, dim=-1))[::-1 if self.reverse else 1]
        dist.all_gather(blocks, local.contiguous())
        return self.down(F.gelu(out))


def test_a_gather_into_blocks_cut_in_the_wrong_order_names_the_cut():
    def verify(reverse: bool) -> scalify.Report:
        return scalify.verify_modules(
            reference=MLP(), rank_module_factory=lambda rank: GatheredMLP(
                FFN // WORLD, reverse).to("meta"),
            world_size=WORLD, example_inputs={"x": torch.randn(TOKENS, HIDDEN)},
            param_placements={"up.weight": Shard(0)}, output_placements=[Replicate()])

    assert verify(reverse=False).verdict == "verified"
    report = verify(reverse=True)
    assert report.verdict == "discrepancy"
    line = _line_of(GatheredMLP.forward, "out.chunk(")
    assert (__file__, line) in report.discrepancies[0].lines()
