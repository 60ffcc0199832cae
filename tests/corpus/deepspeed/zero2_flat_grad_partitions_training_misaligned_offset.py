"""DeepSpeed ZeRO-2 style data parallel training step with an aligned, padded flat ipg buffer whose
copy-back walk advances the offset by each gradient's numel instead of its aligned size, so every
gradient after the first padded one is read from the wrong place in the buffer."""
import torch
import torch.distributed as dist
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = "The copy-back offset skips fc2.bias's padding, so later gradients are read shifted."

IN_FEATURES = 3
HIDDEN = 8
OUT_FEATURES = 3
TOKENS_PER_RANK = 4
NCCL_START_ALIGNMENT_FACTOR = 4  # elements: every gradient starts on an aligned offset


def _aligned_numel(numel: int, alignment: int) -> int:
    remainder = numel % alignment
    return numel if remainder == 0 else numel + alignment - remainder


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT_FEATURES)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction = self.fc2(torch.tanh(self.fc1(x)))
        return ((prediction - target) ** 2).mean()


class Reference(MLP):
    def forward(self, x: torch.Tensor, target: torch.Tensor):
        params = list(self.parameters())
        loss = self.loss(x, target)
        grads = torch.autograd.grad(loss, params)
        return (loss, *grads)


class DeepSpeedZeroOptimizer(MLP):
    """Rank-local module with the stage 1/2 gradient bucket (`ipg_buffer`) and reduction."""

    def __init__(self, world_size: int):
        super().__init__()
        self.dp_process_group = dist.new_group(list(range(world_size)))
        self.partition_count = world_size
        self.nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR

    def get_data_parallel_partitions(self, tensor: torch.Tensor):
        partitions = []
        partition_size = tensor.numel() // self.partition_count
        start = 0
        for _ in range(self.partition_count):
            partitions.append(tensor.narrow(0, start, partition_size))
            start = start + partition_size
        return partitions

    def average_tensor(self, tensor: torch.Tensor) -> None:
        # ZeRO-2 reduces the bucket partition by partition; every rank keeps the whole average.
        for partition in self.get_data_parallel_partitions(tensor):
            dist.all_reduce(partition, group=self.dp_process_group)
        tensor.div_(self.partition_count)

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        params = list(self.parameters())
        loss = self.loss(x, target)
        grads = torch.autograd.grad(loss, params)

        # Gradients become ready in backward order: the bucket is filled last layer first.
        params_in_ipg_bucket = list(reversed(range(len(params))))
        alignment = self.nccl_start_alignment_factor
        elements_in_ipg_bucket = 0
        for index in params_in_ipg_bucket:
            elements_in_ipg_bucket = elements_in_ipg_bucket + _aligned_numel(grads[index].numel(),
                                                                             alignment)
        bucket_alignment = alignment * self.partition_count
        padded_bucket_numel = _aligned_numel(elements_in_ipg_bucket, bucket_alignment)
        self.ipg_buffer = torch.zeros(padded_bucket_numel, dtype=grads[0].dtype)

        offset = 0
        for index in params_in_ipg_bucket:
            numel = grads[index].numel()
            new_grad_tensor = self.ipg_buffer.narrow(0, offset, numel)
            new_grad_tensor.copy_(grads[index].reshape(-1))
            offset = offset + _aligned_numel(numel, alignment)

        self.average_tensor(self.ipg_buffer)

        averaged_grads = [None] * len(params)
        offset = 0
        for index in params_in_ipg_bucket:
            numel = grads[index].numel()
            averaged_grads[index] = self.ipg_buffer.narrow(0, offset, numel).view_as(params[index])
            offset = offset + numel  # BUG

        averaged_loss = loss.detach().clone()
        dist.all_reduce(averaged_loss, group=self.dp_process_group)
        averaged_loss = averaged_loss / self.partition_count
        return (averaged_loss, *averaged_grads)


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DeepSpeedZeroOptimizer(world_size)


def inputs() -> dict[str, torch.Tensor]:
    tokens = TOKENS_PER_RANK * WORLD_SIZE
    return {"x": torch.randn(tokens, IN_FEATURES), "target": torch.randn(tokens, OUT_FEATURES)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "target": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
