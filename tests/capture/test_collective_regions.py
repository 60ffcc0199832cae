"""Collectives inside custom autograd Functions (Megatron's regions), in a training step, and on
sub-groups (`dist.new_group`, a 2-D DeviceMesh's groups)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify
from scalify import Replicate, Shard

HIDDEN, FFN, TOKENS = 8, 16, 4


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced over the group (unless broken)."""

    @staticmethod
    def forward(ctx, x, group, broken):
        ctx.group, ctx.broken = group, broken
        return x

    @staticmethod
    def backward(ctx, grad):
        if not ctx.broken:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN, group=None, broken: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.group, self.broken, self.parallel = group, broken, ffn != FFN

    def layer(self, x):
        if self.parallel:
            x = _CopyToRegion.apply(x, self.group(), self.broken)
        y = self.down(F.gelu(self.up(x)))
        return _ReduceFromRegion.apply(y, self.group()) if self.parallel else y

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        loss = self.layer(x).square().mean()
        return (loss, *torch.autograd.grad(loss, [x, self.up.weight, self.down.weight]))


def _world_group():
    return dist.group.WORLD


def test_backward_collective_is_charged_to_the_functions_backward_line():
    from scalify.capture.ranks import capture_rank
    graph = capture_rank(lambda r: MLP(FFN // 2, _world_group).to("meta"), 0, 2,
                         {"x": torch.empty(TOKENS, HIDDEN, device="meta")},
                         lambda m, i: m(**i), grad=True)
    reductions = [node for node in graph if node.op == "all_reduce"]
    assert [n.source.backward for n in reductions] == [False, True]
    assert "dist.all_reduce(grad" in reductions[1].source.code


def _step(broken: bool, world: int, group, param_chunks=None):
    with torch.device("meta"):
        reference = MLP()
    chunks = param_chunks or tuple(range(world))
    tp = max(chunks) + 1
    shards = {"up.weight": Shard(0, chunk_of_rank=chunks), "down.weight": Shard(1, chunk_of_rank=chunks)}
    return scalify.verify_modules(
        reference, lambda rank: MLP(FFN // tp, group, broken).to("meta"), world,
        {"x": torch.empty(TOKENS, HIDDEN, device="meta")}, shards,
        output_placements=[Replicate(), Replicate(), shards["up.weight"], shards["down.weight"]],
        numeric=True, grad=True)


@pytest.mark.parametrize("broken", [False, True])
def test_autograd_function_regions_in_a_training_step(broken):
    report = _step(broken, 2, _world_group)
    assert report.verified is not broken and report.numeric["agrees"] is not broken
    if broken:  # the input's gradient is a partial sum: the copy region's backward lacks its reduction
        assert "Partial(sum)" in report.discrepancies[0].found


def _new_group():
    """Tensor-parallel pairs {0, 1} and {2, 3} (every rank creates both, in order)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return groups[dist.get_rank() // 2]


def _mesh_group():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group("tp")


@pytest.mark.parametrize("group", [_new_group, _mesh_group], ids=["new_group", "device_mesh"])
@pytest.mark.parametrize("broken", [False, True])
def test_sub_group_regions(group, broken):
    groups = {}

    def cached():  # one group per rank's build, created once (group creation is collective)
        rank = dist.get_rank()
        if groups.get("rank") != rank:
            groups.update(rank=rank, group=group())
        return groups["group"]

    report = _step(broken, 4, cached, param_chunks=(0, 1, 0, 1))
    assert report.verified is not broken and report.numeric["agrees"] is not broken
