"""Hand-written DDP for a small MLP regressor: every parameter is broadcast in place from rank 0
at the start of forward (DDP's initial-state sync), each rank takes the MSE loss on its shard of
the batch, gradients are flattened into one bucket, all-reduced in place, divided by the world
size and split back; the logged loss is all-reduced and averaged into the global mean.
BUG: the gradient bucket is broadcast from rank 0 instead of all-reduced."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "training"
WORLD_SIZE = 2
BUG = "The gradient bucket is broadcast from rank 0 instead of all-reduced, so every rank ends up with half of rank 0's local gradient rather than the average over ranks."

IN, HIDDEN, OUT = 8, 16, 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


class RegressionStep(nn.Module):
    """One training step on one device: MSE loss and the gradient of every parameter."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x, y):
        loss = F.mse_loss(self.net(x), y)
        grads = torch.autograd.grad(loss, list(self.net.parameters()))
        return (loss, *grads)


class MinimalDDP(nn.Module):
    """The same step data-parallel: the batch is split over the ranks."""

    def __init__(self):
        super().__init__()
        self.net = MLP()
        self.world_size = dist.get_world_size()

    def _broadcast_state(self):
        with torch.no_grad():
            for p in self.net.parameters():
                dist.broadcast(p.data, src=0)

    def _allreduce_grads(self, grads):
        sizes = [g.numel() for g in grads]
        bucket = torch.cat([g.contiguous().view(-1) for g in grads])
        dist.broadcast(bucket, src=0)  # BUG
        bucket /= self.world_size
        return [chunk.view_as(g) for chunk, g in zip(torch.split(bucket, sizes), grads)]

    def forward(self, x, y):
        self._broadcast_state()
        params = list(self.net.parameters())
        local_loss = F.mse_loss(self.net(x), y)
        grads = torch.autograd.grad(local_loss, params)
        grads = self._allreduce_grads(grads)
        loss = local_loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss = loss / self.world_size
        return (loss, *grads)


def reference() -> nn.Module:
    return RegressionStep()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return MinimalDDP()


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, IN), "y": torch.randn(4, OUT)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "y": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 7
