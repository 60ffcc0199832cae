"""DDP by hand: parameters broadcast from rank 0 on the first step, the batch is sharded across
ranks, local gradients are flattened into one bucket, all-reduced asynchronously (async_op=True,
.wait()), averaged, and unflattened back into the gradients; the loss is averaged for logging."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "training"
WORLD_SIZE = 2
BUG = None

IN, HIDDEN, CLASSES = 12, 24, 5


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Classifier()

    def compute_grads(self, x, target):
        loss = F.cross_entropy(self.model(x), target)
        grads = torch.autograd.grad(loss, list(self.model.parameters()))
        return loss, grads

    def forward(self, x, target):
        loss, grads = self.compute_grads(x, target)
        return (loss, *grads)


class DDPTrainStep(TrainStep):
    def __init__(self):
        super().__init__()
        self.world_size = dist.get_world_size()
        self._params_synced = False

    @torch.no_grad()
    def _sync_params(self):
        for p in self.model.parameters():
            dist.broadcast(p, src=0)
        self._params_synced = True

    def forward(self, x, target):
        if not self._params_synced:
            self._sync_params()
        loss, grads = self.compute_grads(x, target)
        grads = [g.clone() for g in grads]
        bucket = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(bucket, op=dist.ReduceOp.SUM, async_op=True)
        loss = loss.detach().clone()
        loss_work = dist.all_reduce(loss, async_op=True)
        work.wait()
        bucket.div_(self.world_size)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(bucket[offset:offset + n].view_as(g))
            offset += n
        loss_work.wait()
        return (loss / self.world_size, *grads)


def reference() -> nn.Module:
    return TrainStep()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DDPTrainStep()


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(6, IN), "target": torch.randint(0, CLASSES, (6,))}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "target": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 7
