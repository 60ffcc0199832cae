"""Writes into views reach their base, and reads of other views see them: the captured graph
computes what PyTorch computes (run by the IR interpreter)."""
import pytest
import torch
from torch import nn

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph


def _filled_block_by_block(x):
    buf = torch.empty(4, 6, dtype=x.dtype)
    buf[:, 2:4] = x[:, :2]
    buf[:, :2] = x[:, 2:4] * 2
    buf[:, 4:] = x[:, 4:]
    return buf + 1


def _added_into_rows(x):
    buf = torch.zeros(4, 6, dtype=x.dtype)
    rows = buf[1:3]
    rows.add_(x[1:3])
    return buf * 2


def _through_a_transpose(x):
    y = x.clone()
    y[0].mul_(3)
    y.t()[1:3] = 0
    return y


def _cache_slots(x):
    cache = torch.zeros(2, 4, 6, dtype=x.dtype)
    cache[0].copy_(x)
    cache.select(0, 1).copy_(x * 2)
    return cache.sum(0)


def _stale_view_read_after_write(x):
    y = x.clone()
    head = y[:2]
    y.mul_(2)  # head, a view, now reads doubled values
    return head + 1


def _nested_views(x):
    buf = torch.zeros(3, 4, 6, dtype=x.dtype)
    buf[1, :, 2:5] = x[:, :3]
    buf[2][1:3].copy_(x[:2])
    return buf


def _detached_gradient_overwritten(x):
    g = (x * 3).detach()
    g.copy_(g / 2)  # a gradient bucket copied back in place, as DDP-style code does
    return g


def _through_a_reshaped_view(x):
    y = x.clone()
    y.view(2, 2, 6).mul_(2)  # a [s, b, h] view of a [s*b, h] buffer, as sequence-first code has
    y.view(24)[6:12].zero_()  # whole rows of a flat view
    y.view(2, 12)[1, 6:].add_(1)  # a row of a 2-row view: row 3 of the base
    return y


def _paged_cache_slot_range(x):
    """vLLM-style: a step's tokens written at slots 3..6 of a paged cache [2 (k, v), 3 blocks,
    4 slots, 6], through a flat-slots view: the range crosses a block boundary."""
    cache = torch.zeros(2, 3, 4, 6, dtype=x.dtype)
    keys = cache[0].view(-1, 6)
    keys[3:7] = x
    cache[1].view(-1, 6)[5:9].copy_(x * 2)
    return cache[1].view(-1, 6)[:9] + keys[:9]


CASES = [_filled_block_by_block, _added_into_rows, _through_a_transpose, _cache_slots,
         _stale_view_read_after_write, _nested_views, _detached_gradient_overwritten,
         _through_a_reshaped_view, _paged_cache_slot_range]


@pytest.mark.parametrize("program", CASES, ids=lambda f: f.__name__.strip("_"))
def test_writes_into_views_compute_what_torch_computes(program):
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    graph = capture(nn.Module(), lambda: program(x), {"x": x})
    assert not [n for n in graph if n.op == "opaque"]
    assert torch.allclose(run_graph(graph, {"x": x})[graph.outputs[0]], program(x))


def test_a_view_across_blocks_is_read_as_a_slice_of_merged_dims():
    """Slots 3..6 of [blocks, slots, 6] read as one slice of [blocks * slots, 6], not as a walk
    through flat memory (which would hide the slot dim from the relations)."""
    x = torch.randn(4, 6, dtype=torch.float64)

    def program(x):
        cache = torch.zeros(2, 3, 4, 6, dtype=x.dtype)
        cache[0].view(-1, 6)[3:7] = x
        return cache[0].view(-1, 6)[2:8]

    graph = capture(nn.Module(), lambda: program(x), {"x": x})
    assert not [n for n in graph if n.op == "merge" and len(n.shape) == 1]
    assert torch.allclose(run_graph(graph, {"x": x})[graph.outputs[0]], program(x))


class _GradBuffer(nn.Module):
    """Megatron-style: one flat buffer made before capture (not a parameter or buffer), each
    gradient a view of it cut before capture; the step adds into the views in place."""

    def __init__(self):
        super().__init__()
        self.flat = torch.zeros(24, dtype=torch.float64)
        self.views = [self.flat[:12].view(2, 6), self.flat[12:].view(2, 6)]

    def forward(self, x):
        self.views[1].add_(x[:2])
        self.views[0].add_(x[2:] * 2)
        return self.flat * 0.5


def test_writes_through_views_cut_before_capture_reach_their_base():
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    module = _GradBuffer()
    graph = capture(module, lambda: module(x), {"x": x})
    expected = torch.cat([x[2:].reshape(-1) * 2, x[:2].reshape(-1)]) * 0.5
    # the constant is held as it was before the writes (capture ran them on the real buffer)
    assert torch.allclose(run_graph(graph, {"x": x})[graph.outputs[0]], expected)


def test_a_write_into_a_view_that_is_no_block_is_opaque():
    """The diagonal is no block of its base: the written base is opaque (unknown), never a
    value that misses the write."""
    x = torch.randn(6, 6, dtype=torch.float64)

    def program(x):
        y = x.clone()
        y.diagonal().copy_(torch.ones(6, dtype=x.dtype))
        return y

    graph = capture(nn.Module(), lambda: program(x), {"x": x})
    assert [n for n in graph if n.op == "opaque"]

