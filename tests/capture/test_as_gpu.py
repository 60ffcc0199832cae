"""Code written for GPUs captures on a CPU machine: CUDA devices, RNG state, streams, events
and NVTX calls work during capture, and CUDA tensors land on the capture device."""
import contextlib

import pytest

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify
from scalify import Replicate, Shard
from scalify.capture.as_gpu import as_gpu

HIDDEN, FFN, TOKENS = 8, 16, 4


class RngTracker:
    """Megatron-Core's CudaRNGStatesTracker.fork, as `tensor_parallel/random.py` writes it."""

    def __init__(self) -> None:
        torch.cuda.manual_seed(1234)
        self.states = {"model-parallel-rng": torch.cuda.get_rng_state()}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        orig = torch.cuda.get_rng_state()
        self._set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.cuda.default_generators[torch.cuda.current_device()].get_state()
            self._set_state(orig)

    @staticmethod
    def _set_state(state: torch.Tensor) -> None:
        def callback():
            torch.cuda.default_generators[torch.cuda.current_device()].set_state(state)
        torch.cuda._lazy_call(callback)


class GpuStyleMLP(nn.Module):
    """Allocates on `torch.cuda.current_device()`, moves with `.cuda()`, runs in a stream and an
    RNG fork; the ranks all-reduce through a buffer allocated on the GPU."""

    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
        self.up = nn.Linear(HIDDEN, ffn, bias=False, device=torch.cuda.current_device())
        self.down = nn.Linear(ffn, HIDDEN, bias=False, device="cuda")
        self.tracker = RngTracker()

    def forward(self, x):
        x = x.cuda()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), self.tracker.fork():
            torch.cuda.nvtx.range_push("mlp")
            y = self.down(F.gelu(self.up(x.to("cuda"))))
            torch.cuda.nvtx.range_pop()
        torch.cuda.current_stream().wait_stream(stream)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        if dist.is_initialized():
            buffer = torch.empty(y.shape, device=torch.cuda.current_device(), dtype=y.dtype)
            buffer.copy_(y)
            dist.all_reduce(buffer)
            y = buffer
        torch.cuda.synchronize()
        return y.to(torch.device("cuda", 0))


def test_gpu_style_module_verifies():
    with torch.device("meta"), as_gpu("meta"):
        reference = GpuStyleMLP()
    report = scalify.verify_modules(
        reference, lambda rank: GpuStyleMLP(FFN // 2), 2,
        {"x": torch.empty(TOKENS, HIDDEN, device="meta")},
        {"up.weight": Shard(0), "down.weight": Shard(1)}, output_placements=[Replicate()],
        numeric=True)
    assert report.verified and report.numeric["agrees"]


def test_patches_are_restored():
    available = torch.cuda.is_available()
    with as_gpu("meta"):
        assert torch.cuda.is_available() and torch.empty(2, device="cuda").is_meta
        assert torch.zeros(2, device=0).is_meta and torch.ones(1).cuda().is_meta
    assert torch.cuda.is_available() == available
    assert not hasattr(torch.cuda, "default_generators") or torch.cuda.default_generators == ()


class _GatherSequence(torch.autograd.Function):
    """Megatron's sequence-parallel gather: all-gather the rows forward, reduce-scatter the
    gradient backward; both allocate on `torch.cuda.current_device()`."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty((2 * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=torch.cuda.current_device())
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty((grad.shape[0] // 2, *grad.shape[1:]), dtype=grad.dtype,
                           device=torch.cuda.current_device())
        dist.reduce_scatter_tensor(mine, grad.contiguous())
        return mine


class _SequenceParallelStep(nn.Module):
    """A scale (a norm's weight) on sequence-parallel rows, gathered into a column-parallel
    layer; a training step, the scale's gradient summed over the rows' ranks."""

    def __init__(self, ranks: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(HIDDEN))
        self.up, self.ranks = nn.Linear(HIDDEN, FFN // 2 if ranks else FFN, bias=False), ranks

    def forward(self, x):
        rows = x * self.scale
        rows = _GatherSequence.apply(rows) if self.ranks else rows
        loss = F.gelu(self.up(rows)).pow(2).sum()  # on the ranks, their columns' share
        scale, up = torch.autograd.grad(loss, [self.scale, self.up.weight])
        if self.ranks:
            loss = funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)
            scale = funcol.all_reduce(scale, "sum", dist.group.WORLD)
        return loss, scale, up


def test_a_custom_function_allocating_on_the_gpu_in_its_backward_verifies():
    """The autograd engine runs a Function's backward without Python function modes; the
    capture still puts its CUDA allocations where the capture runs."""
    report = scalify.verify_modules(
        _SequenceParallelStep(False), lambda rank: _SequenceParallelStep(True), 2,
        {"x": torch.randn(TOKENS, HIDDEN)}, {"up.weight": Shard(0)}, {"x": Shard(0)},
        output_placements=[Replicate(), Replicate(), Shard(0)], numeric=True, grad=True)
    assert report.verdict == "verified", report.discrepancies or report.unknown
    assert report.numeric["agrees"]


class MegatronTrackedMLP(nn.Module):
    """An MLP run inside Megatron-Core's own CudaRNGStatesTracker fork (the tracker reads and
    sets CUDA state through `torch.cuda.random` and compares CPU generator states)."""

    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.tracker = CudaRNGStatesTracker()
        self.tracker.add("model-parallel-rng", 1234)

    def forward(self, x):
        with self.tracker.fork():
            return self.down(F.gelu(self.up(x)))


def test_megatron_cores_rng_tracker_runs_during_capture():
    pytest.importorskip("megatron.core")
    with as_gpu("meta"):
        reference = MegatronTrackedMLP()
    report = scalify.verify_modules(
        reference, lambda rank: MegatronTrackedMLP(), 2, {"x": torch.randn(TOKENS, HIDDEN)},
        output_placements=[Replicate()], numeric=True)
    assert report.verified and report.numeric["agrees"]
