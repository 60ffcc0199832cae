"""Megatron-LM-style column-parallel LM head, vocab-parallel cross entropy masked by torch.where."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import Parameter

import scalify

STYLE = "megatron_lm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN_SIZE = 16
VOCAB_SIZE = 32


def get_tensor_model_parallel_group():
    return dist.group.WORLD


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_tensor_model_parallel_group())


class VocabUtility:
    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size


class ColumnParallelLinear(nn.Module):  # gather_output=False, no bias
    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = output_size // world_size
        self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size))

    def forward(self, input_):
        input_parallel = input_  # copy_to_tensor_model_parallel_region: identity forward
        output_parallel = F.linear(input_parallel, self.weight)
        return output_parallel, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    # Maximum value along vocab dimension across all GPUs.
    logits_max = torch.max(vocab_parallel_logits, dim=-1)[0].detach()
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=get_tensor_model_parallel_group())
    # Subtract the maximum value.
    vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

    # Get the partition's vocab indices.
    partition_vocab_size = vocab_parallel_logits.size()[-1]
    rank = get_tensor_model_parallel_rank()
    world_size = get_tensor_model_parallel_world_size()
    vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, rank, world_size)

    # Create a mask of valid vocab ids (1 means it needs to be masked).
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = torch.where(target_mask, 0, target - vocab_start_index)

    # Get predicted-logits = logits[target].
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
    predicted_logits = predicted_logits_1d.view_as(target)
    predicted_logits = torch.where(target_mask, 0.0, predicted_logits)
    # All reduce is needed to get the chunks from other GPUs.
    dist.all_reduce(predicted_logits, op=dist.ReduceOp.SUM, group=get_tensor_model_parallel_group())

    # Sum of exponential of logits along vocab dimension across all GPUs.
    exp_logits = torch.exp(vocab_parallel_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)
    dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=get_tensor_model_parallel_group())

    # Loss = log(sum(exp(logits))) - predicted-logit.
    return torch.log(sum_exp_logits) - predicted_logits


class ParallelLMHeadLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.output_layer = ColumnParallelLinear(HIDDEN_SIZE, VOCAB_SIZE)

    def forward(self, hidden_states, labels):
        logits, _ = self.output_layer(hidden_states)
        loss = vocab_parallel_cross_entropy(logits, labels)
        return loss.mean()


class LMHeadLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.output_layer = nn.Linear(HIDDEN_SIZE, VOCAB_SIZE, bias=False)

    def forward(self, hidden_states, labels):
        logits = self.output_layer(hidden_states)
        return F.cross_entropy(logits.view(-1, VOCAB_SIZE), labels.view(-1))


def reference() -> nn.Module:
    return LMHeadLoss()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return ParallelLMHeadLoss()


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(2, 5, HIDDEN_SIZE, generator=g),
            "labels": torch.tensor([[0, 15, 16, 31, 7], [20, 16, 3, 15, 26]], dtype=torch.long)}


PARAM_PLACEMENTS = {"output_layer.weight": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
