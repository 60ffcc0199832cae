"""A data-parallel step over a flat buffer whose partitions straddle parameters (ZeRO-1: each
rank steps its own partition of the flat weights with the all-reduced flat gradients, in place
with a negative scale, and gathers the partitions back) verifies; a rank that skips the gather
is caught where the parameters are read back."""
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

from .helpers import assert_caught, assert_verified

WORLD, LR = 2, 0.1


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)  # 12 + 4 elements: the partitions of 8 cut the weight


class Step(nn.Module):
    """One SGD step on the whole batch: (loss, weight, bias after the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()

    def forward(self, x, y):
        params = list(self.model.parameters())
        loss = F.mse_loss(self.model.fc(x), y)
        grads = torch.autograd.grad(loss, params)
        return (loss.detach(), *[p.detach() - LR * g for p, g in zip(params, grads)])


class FlatPartitionStep(Step):
    def __init__(self, gather: bool = True) -> None:
        super().__init__()
        self.gather = gather

    def forward(self, x, y):
        rank, params = dist.get_rank(), list(self.model.parameters())
        loss = F.mse_loss(self.model.fc(x), y)
        grads = torch.autograd.grad(loss, params)
        flat_grads = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat_grads)
        flat_grads.div_(WORLD)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        size = flat.numel() // WORLD
        partitions = list(flat.split(size))
        mine = partitions[rank].clone()
        mine.add_(flat_grads.narrow(0, rank * size, size), alpha=-LR)
        partitions[rank].copy_(mine)
        if self.gather:
            dist.all_gather(partitions, partitions[rank].clone())
        weight, bias = flat[:12].view(4, 3), flat[12:]  # read back
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / WORLD, weight, bias


def _verify(gather: bool):
    return scalify.verify_modules(
        reference=Step(), rank_module_factory=lambda rank: FlatPartitionStep(gather),
        world_size=WORLD, example_inputs={"x": torch.randn(4, 3), "y": torch.randn(4, 4)},
        param_placements={}, input_placements={"x": scalify.Shard(0), "y": scalify.Shard(0)},
        output_placements=[scalify.Replicate()] * 3, numeric=True, grad=True)


def test_a_flat_partition_stepped_in_place_and_gathered_back_verifies():
    report = _verify(gather=True)
    assert_verified(report)


def test_a_partition_never_gathered_back_is_caught_where_the_weights_are_read():
    report = _verify(gather=False)
    assert_caught(report)
    lines = {line for _, line in report.discrepancies[0].lines()}
    source, start = inspect.getsourcelines(FlatPartitionStep.forward)
    read_back = start + next(i for i, text in enumerate(source) if "# read back" in text)
    assert read_back in lines
