"""Megatron-LM GPT head training step in [seq, batch, hidden] layout: replicated final LayerNorm,
ColumnParallelLinear output layer (vocab split over tp ranks, input through
copy_to_tensor_model_parallel_region), _VocabParallelCrossEntropy with its hand-written backward,
loss averaged under a loss mask; returns the loss and every parameter's gradient."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, HIDDEN, SEQ, BATCH = 16, 8, 4, 2


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        if dist.get_world_size() == 1:
            return grad_output
        grad_output = grad_output.contiguous()
        dist.all_reduce(grad_output)
        return grad_output


def copy_to_tensor_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


class VocabUtility:
    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

        partition_vocab_size = vocab_parallel_logits.size()[-1]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size)

        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits)

        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits)

        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size // dist.get_world_size(), input_size))

    def forward(self, input_):
        input_parallel = copy_to_tensor_model_parallel_region(input_)
        return F.linear(input_parallel, self.weight), None


class GPTHead(nn.Module):
    """The rank's final_layernorm + output_layer + loss; hidden_states is [s, b, h]."""

    def __init__(self):
        super().__init__()
        self.final_layernorm = nn.LayerNorm(HIDDEN)
        self.output_layer = ColumnParallelLinear(HIDDEN, VOCAB)

    def forward(self, hidden_states, labels, loss_mask):
        logits, _ = self.output_layer(self.final_layernorm(hidden_states))   # [s, b, v/tp]
        labels = labels.transpose(0, 1).contiguous()                           # [b, s] -> [s, b]
        losses = vocab_parallel_cross_entropy(logits, labels).transpose(0, 1).contiguous()
        loss_mask = loss_mask.view(-1)
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        params = [self.final_layernorm.weight, self.final_layernorm.bias, self.output_layer.weight]
        return (loss, *torch.autograd.grad(loss, params))


class ReferenceHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.final_layernorm = nn.LayerNorm(HIDDEN)
        self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden_states, labels, loss_mask):
        logits = self.output_layer(self.final_layernorm(hidden_states)).transpose(0, 1)
        losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        loss = (losses * loss_mask.reshape(-1)).sum() / loss_mask.sum()
        params = [self.final_layernorm.weight, self.final_layernorm.bias, self.output_layer.weight]
        return (loss, *torch.autograd.grad(loss, params))


def reference():
    return ReferenceHead()


def rank_module(rank, world_size):
    return GPTHead()


def inputs():
    return {"hidden_states": torch.randn(SEQ, BATCH, HIDDEN),
            "labels": torch.tensor([[3, 12, 7, 9], [15, 0, 8, 5]]),
            "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])}


PARAM_PLACEMENTS = {"output_layer.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Replicate(), scalify.Replicate(),
                     scalify.Shard(0)]
