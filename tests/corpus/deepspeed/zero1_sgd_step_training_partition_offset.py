"""One DeepSpeed ZeRO stage-1 style SGD step on a 2-layer MLP: flat all-reduced gradients, each
data-parallel rank steps only its partition of the flat fp32 master weights, then the updated
partitions are all-gathered back; but the gradient partition's offset ignores the padding."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _unflatten_dense_tensors

import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = ("the gradient partition starts at partition_id * (unpadded numel // world size), "
       "so a rank past the first steps its weights with gradients shifted off its partition")

IN_FEATURES = 4
HIDDEN = 8
OUT_FEATURES = 3   # 4*8 + 8 + 8*3 + 3 = 67 elements: the flat buffer needs one element of padding
LR = 0.1


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.linear2 = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class ReferenceSGDStep(nn.Module):
    """One SGD step on the whole batch: (loss, *parameters after the step)."""

    def __init__(self):
        super().__init__()
        self.module = SimpleModel()

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        params = list(self.module.parameters())
        loss = F.mse_loss(self.module(x), y)
        grads = torch.autograd.grad(loss, params)
        updated = [p.detach() - LR * g for p, g in zip(params, grads)]
        return (loss.detach(), *updated)


def flatten_dense_tensors_aligned(tensor_list, alignment):
    """DeepSpeed's flat buffer: the tensors end to end, zero-padded to a multiple of
    `alignment` so that it splits evenly into data-parallel partitions."""
    num_elements = sum(t.numel() for t in tensor_list)
    remaining = num_elements % alignment
    if remaining:
        pad = torch.zeros(alignment - remaining, dtype=tensor_list[0].dtype,
                          device=tensor_list[0].device)
        tensor_list = list(tensor_list) + [pad]
    return torch.cat([t.contiguous().view(-1) for t in tensor_list])


def get_data_parallel_partitions(tensor, dp_world_size):
    partition_size = tensor.numel() // dp_world_size
    return [tensor.narrow(0, dp_rank * partition_size, partition_size)
            for dp_rank in range(dp_world_size)]


class DeepSpeedZeroOptimizerStage1(nn.Module):
    """Engine + ZeRO-1 optimizer for one training step: forward, backward, gradient all-reduce,
    partitioned SGD step on the fp32 master partition, all-gather of the updated weights."""

    def __init__(self, dp_process_group=None):
        super().__init__()
        self.module = SimpleModel()
        self.dp_process_group = dp_process_group
        self.partition_id = dist.get_rank(group=dp_process_group)
        self.partition_count = dist.get_world_size(group=dp_process_group)
        self.nccl_start_alignment_factor = 2

    def allreduce_gradients(self, grads):
        flat_grads = flatten_dense_tensors_aligned(
            grads, self.nccl_start_alignment_factor * self.partition_count)
        dist.all_reduce(flat_grads, group=self.dp_process_group)
        flat_grads.div_(self.partition_count)
        return flat_grads

    def step(self, params, flat_grads):
        num_elements = sum(p.numel() for p in params)
        bit16_groups_flat = flatten_dense_tensors_aligned(
            [p.detach() for p in params], self.nccl_start_alignment_factor * self.partition_count)
        partition_size = bit16_groups_flat.numel() // self.partition_count
        data_parallel_partitions = get_data_parallel_partitions(bit16_groups_flat,
                                                                self.partition_count)

        # the fp32 master copy of this rank's partition (the model is already fp32 here)
        single_partition_of_fp32_groups = \
            data_parallel_partitions[self.partition_id].clone().detach()
        grad_start = self.partition_id * (num_elements // self.partition_count)  # BUG
        single_grad_partition = flat_grads.narrow(0, grad_start, partition_size)

        # SGD on the partition this rank owns
        single_partition_of_fp32_groups.add_(single_grad_partition, alpha=-LR)

        # all_gather_dp_groups: every rank gets every updated partition
        data_parallel_partitions[self.partition_id].copy_(single_partition_of_fp32_groups)
        dist.all_gather(data_parallel_partitions,
                        data_parallel_partitions[self.partition_id].clone(),
                        group=self.dp_process_group)

        # _update_model_bit16_weights
        updated_params = _unflatten_dense_tensors(bit16_groups_flat.narrow(0, 0, num_elements),
                                                  params)
        with torch.no_grad():
            for p, q in zip(params, updated_params):
                p.copy_(q)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        params = list(self.module.parameters())
        loss = F.mse_loss(self.module(x), y)
        grads = torch.autograd.grad(loss, params)

        flat_grads = self.allreduce_gradients(grads)
        self.step(params, flat_grads)

        # the reported loss is the data-parallel mean (equal micro-batches on every rank)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=self.dp_process_group)
        loss.div_(self.partition_count)
        return (loss, *[p.detach() for p in params])


def reference() -> nn.Module:
    return ReferenceSGDStep()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DeepSpeedZeroOptimizerStage1(dp_process_group=dist.group.WORLD)


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(8, IN_FEATURES), "y": torch.randn(8, OUT_FEATURES)}


PARAM_PLACEMENTS = {}   # data parallel: every rank holds the whole model
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "y": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5   # loss, linear1.{weight,bias}, linear2.{weight,bias}
