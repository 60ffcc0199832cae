"""DeepSpeed engine data-parallel training step (ZeRO stage 0, one contiguous gradient bucket):
each gradient is copied into its slice of a preallocated flat bucket whose slices start at
nccl_start_alignment_factor-aligned offsets, the bucket is all-reduced and divided by the
dp world size, and every slice is copied back into its gradient; the loss is an MSE regression
loss averaged over each rank's micro-batch (batch sharded over dp ranks)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = None

IN, HID, OUT = 8, 6, 4
NCCL_START_ALIGNMENT_FACTOR = 4   # elements; fc1.bias (6) is padded to 8 in the bucket


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, OUT, bias=False)

    def loss(self, x, target):
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), target)

    def forward(self, x, target):
        loss = self.loss(x, target)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class DeepSpeedEngine(nn.Module):
    def __init__(self, module, dp_group=None):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp_world_size = dist.get_world_size(group=dp_group)
        self.nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR

    def _aligned_numel(self, numel):
        alignment = self.nccl_start_alignment_factor
        return (numel + alignment - 1) // alignment * alignment

    def allreduce_bucket_and_copy_back(self, grads):
        bucket_numel = sum(self._aligned_numel(g.numel()) for g in grads)
        ipg_buffer = torch.zeros(bucket_numel, dtype=grads[0].dtype, device=grads[0].device)
        offset = 0
        for grad in grads:
            numel = grad.numel()
            ipg_buffer[offset:offset + numel].copy_(grad.view(-1))
            offset += self._aligned_numel(numel)
        dist.all_reduce(ipg_buffer, group=self.dp_group)
        ipg_buffer.div_(self.dp_world_size)
        offset = 0
        for grad in grads:
            numel = grad.numel()
            grad.copy_(ipg_buffer[offset:offset + numel].view_as(grad))
            offset += self._aligned_numel(numel)

    def forward(self, x, target):
        loss = self.module.loss(x, target)
        grads = [g.detach() for g in torch.autograd.grad(loss, list(self.module.parameters()))]
        self.allreduce_bucket_and_copy_back(grads)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, group=self.dp_group)
        return (reduced / self.dp_world_size, *grads)


def reference():
    return Regressor()


def rank_module(rank, world_size):
    return DeepSpeedEngine(Regressor())


def shard(state, rank, world_size):
    return {f"module.{k}": v.clone() for k, v in state.items()}


def inputs():
    return {"x": torch.randn(4, IN), "target": torch.randn(4, OUT)}


INPUT_PLACEMENTS = {"x": scalify.Shard(0), "target": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 4
