"""Every collective style a user writes is captured and verified: in-place c10d collectives
(sync and async), functional collectives, DTensor redistributions, collectives inside autograd
Functions (forward and backward), on the world, a `new_group` sub-group or a DeviceMesh's groups.
Each style has a broken twin that must be a discrepancy."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify
from scalify import Replicate, Shard

HIDDEN, FFN, TOKENS = 8, 16, 4


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def partial(self, x):
        return self.down(F.gelu(self.up(x)))

    def forward(self, x):
        return self.partial(x)


def _rank_mlp(tp: int) -> MLP:
    return MLP(FFN // tp).to("meta")


# Row-parallel styles: each rank's output is a partial sum over its FFN shard.
def all_reduce_inplace(m, x, broken):
    y = m.partial(x)
    if not broken:
        dist.all_reduce(y)
    return y


def all_reduce_async(m, x, broken):
    y = m.partial(x)
    before = y.clone()
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    return before if broken else y  # broken: a copy taken before the reduction


def reduce_to_root(m, x, broken):
    y = m.partial(x)
    if not broken:
        dist.reduce(y, dst=0)
    return y


def functional(m, x, broken):
    y = m.partial(x)
    return y if broken else funcol.all_reduce(y, "sum", dist.group.WORLD)


def dtensor_redistribute(m, x, broken):
    from torch.distributed.tensor import DTensor, Partial, Replicate as R, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    y = DTensor.from_local(m.partial(x), mesh, [R() if broken else Partial()])
    return y.redistribute(mesh, [R()]).to_local()


# Column-parallel styles: each rank holds a slice of the FFN activations, gathered.
def all_gather_into_tensor(m, x, broken):
    """Sequence parallel: x is Shard(0) along tokens, gathered before a replicated layer."""
    out = torch.empty(TOKENS, HIDDEN, device=x.device)
    dist.all_gather_into_tensor(out, x * 2 if broken and dist.get_rank() else x)
    return m.up(out)


def all_gather_list(m, x, broken):
    y = m.up(x)
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y)
    return torch.cat(parts[::-1] if broken else parts, -1)


# Sequence-parallel styles: the output is scattered along tokens.
def reduce_scatter_tensor(m, x, broken):
    y = m.partial(x)
    world, rank = dist.get_world_size(), dist.get_rank()
    if broken:
        return y.chunk(world)[rank]
    out = torch.empty(TOKENS // world, HIDDEN, device=y.device)
    dist.reduce_scatter_tensor(out, y)
    return out


def all_to_all(m, x, broken):
    """Tokens-sharded input to hidden-sharded output (x is Shard(0), the result Shard(1))."""
    world = dist.get_world_size()
    blocks = x.reshape(x.shape[0], world, HIDDEN // world).transpose(0, 1).contiguous()
    send = blocks.reshape(world * x.shape[0], HIDDEN // world)
    if broken:
        return send.reshape(TOKENS, HIDDEN // world) * 2
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)
    return received.reshape(TOKENS, HIDDEN // world) * 2


def broadcast(m, x, broken):
    """The root's x on every rank (the others hold zeros until it arrives)."""
    held = x if dist.get_rank() == 0 else torch.zeros_like(x)
    dist.broadcast(held, src=1 if broken else 0)
    return m.up(held)


def scatter(m, x, broken):
    """Rank r keeps block r of the root's x (the others pass no list)."""
    out = torch.empty_like(x.chunk(dist.get_world_size())[0])
    blocks = list(x.chunk(dist.get_world_size()))
    dist.scatter(out, (blocks[::-1] if broken else blocks) if dist.get_rank() == 0 else None, src=0)
    return m.up(out)


class Reference(MLP):
    def __init__(self, style) -> None:
        super().__init__()
        self.style = style

    def forward(self, x):
        if self.style in (all_gather_into_tensor, all_gather_list, broadcast, scatter):
            return self.up(x)
        return x * 2 if self.style is all_to_all else self.partial(x)


class Ranked(MLP):
    def __init__(self, style, broken: bool, tp: int) -> None:
        super().__init__(FFN // tp)
        self.style, self.broken = style, broken

    def forward(self, x):
        return self.style(self, x, self.broken)


_PARAMS = {"up.weight": Shard(0), "down.weight": Shard(1)}
STYLES = {  # style: (param placements, input placements, output placement)
    all_reduce_inplace: (_PARAMS, {}, Replicate()),
    all_reduce_async: (_PARAMS, {}, Replicate()),
    reduce_to_root: (_PARAMS, {}, Replicate()),
    functional: (_PARAMS, {}, Replicate()),
    dtensor_redistribute: (_PARAMS, {}, Replicate()),
    all_gather_into_tensor: ({}, {"x": Shard(0)}, Replicate()),
    all_gather_list: (_PARAMS, {}, Replicate()),
    reduce_scatter_tensor: (_PARAMS, {}, Shard(0)),
    all_to_all: ({}, {"x": Shard(0)}, Shard(1)),
    broadcast: ({}, {}, Replicate()),
    scatter: ({}, {}, Shard(0)),
}


def _verify(style, broken: bool, world: int = 2):
    params, inputs, output = STYLES[style]
    with torch.device("meta"):
        reference = Reference(style)
    return scalify.verify_modules(
        reference, lambda rank: Ranked(style, broken, world if params else 1).to("meta"), world,
        {"x": torch.empty(TOKENS, HIDDEN, device="meta")}, params, inputs, [output], numeric=True)


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.__name__)
def test_collective_style_verifies(style):
    report = _verify(style, broken=False)
    assert report.numeric["agrees"]
    assert report.verified, report.discrepancies[:1] or report.unknown


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.__name__)
def test_broken_twin_is_a_discrepancy(style):
    report = _verify(style, broken=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]


class _ExchangedAsLists(nn.Module):
    """Blocks exchanged as lists (`dist.all_to_all`, which has no lowering)."""

    def forward(self, x):  # called with the rank's whole x, as `arg0`
        out = [torch.empty_like(block) for block in x.chunk(2)]
        dist.all_to_all(out, list(x.chunk(2)))
        return torch.cat(out)


def test_a_collective_with_no_lowering_is_unknown_not_a_crash():
    report = scalify.verify_modules(
        nn.Identity(), lambda rank: _ExchangedAsLists(), 2,
        (torch.empty(TOKENS, HIDDEN, device="meta"),), output_placements=[Replicate()])
    assert report.verdict == "unknown" and any("alltoall" in reason for reason in report.unknown)
