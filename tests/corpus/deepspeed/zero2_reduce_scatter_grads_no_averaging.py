"""DeepSpeed ZeRO stage 2 style data parallel step (flattened bucket reduce-scattered, partitions
all-gathered); BUG: the bucket is not divided by the dp world size, so gradients are summed."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = "average_tensor reduce-scatters the gradient bucket without dividing by the data-parallel world size, so gradients are summed instead of averaged."

IN, HID, OUT = 8, 12, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, OUT)

    def loss(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


class Reference(Net):
    def forward(self, x, y):
        loss = self.loss(x, y)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        return (loss, *grads)


class DeepSpeedZeroOptimizerStage2:
    """The gradient path of a stage-2 optimizer: one bucket, partitioned over the dp group."""

    def __init__(self, params, dp_process_group=None):
        self.params = list(params)
        self.dp_process_group = dp_process_group
        self.partition_count = dist.get_world_size(group=dp_process_group)
        self.partition_id = dist.get_rank(group=dp_process_group)

    def average_tensor(self, tensor):
        partition_size = tensor.numel() // self.partition_count
        partition = torch.empty(partition_size, dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_tensor(partition, tensor, op=dist.ReduceOp.SUM, group=self.dp_process_group)  # BUG
        return partition

    def reduce_gradients(self, grads):
        flat = _flatten_dense_tensors(grads)
        padding = (-flat.numel()) % self.partition_count
        if padding:
            flat = torch.cat([flat, flat.new_zeros(padding)])
        my_partition = self.average_tensor(flat)
        # ... the optimizer would step on my_partition here; then all ranks rebuild the full buffer
        full = torch.empty_like(flat)
        dist.all_gather_into_tensor(full, my_partition, group=self.dp_process_group)
        return _unflatten_dense_tensors(full[:flat.numel() - padding], grads)


class DataParallelEngine(Net):
    def __init__(self):
        super().__init__()
        self.optimizer = DeepSpeedZeroOptimizerStage2(self.parameters())

    def forward(self, x, y):
        loss = self.loss(x, y)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        grads = self.optimizer.reduce_gradients([g.detach() for g in grads])
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        return (reported / self.optimizer.partition_count, *grads)


def reference():
    return Reference()


def rank_module(rank, world_size):
    return DataParallelEngine()


def inputs():
    return {"x": torch.randn(4, IN), "y": torch.randn(4, OUT)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "y": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
