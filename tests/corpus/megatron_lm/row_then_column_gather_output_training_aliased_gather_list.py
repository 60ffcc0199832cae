"""Megatron-LM (mpu) RowParallel -> ColumnParallel(gather_output=True) training step -- BUG: the
all_gather output list is built as [t] * world_size, so every entry aliases one buffer and the
gathered logits repeat a single rank's shard."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "training"
WORLD_SIZE = 2
BUG = '_gather_along_last_dim builds its all_gather output list with [torch.empty_like(input_)] * world_size, so the entries alias one tensor and the concatenated logits repeat one shard.'

HIDDEN, NUM_CLASSES = 16, 12

_TENSOR_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_):
    global _TENSOR_MODEL_PARALLEL_GROUP
    for i in range(dist.get_world_size() // tensor_model_parallel_size_):
        ranks = list(range(i * tensor_model_parallel_size_, (i + 1) * tensor_model_parallel_size_))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def _reduce(input_):
    dist.all_reduce(input_, group=get_tensor_model_parallel_group())
    return input_


def _split_along_last_dim(input_):
    world_size = dist.get_world_size(group=get_tensor_model_parallel_group())
    rank = dist.get_rank(group=get_tensor_model_parallel_group())
    last_dim_size = input_.size()[-1] // world_size
    input_list = torch.split(input_, last_dim_size, dim=input_.dim() - 1)
    return input_list[rank].contiguous()


def _gather_along_last_dim(input_):
    world_size = dist.get_world_size(group=get_tensor_model_parallel_group())
    rank = dist.get_rank(group=get_tensor_model_parallel_group())
    last_dim = input_.dim() - 1
    tensor_list = [torch.empty_like(input_)] * world_size  # BUG
    dist.all_gather(tensor_list, input_.contiguous(), group=get_tensor_model_parallel_group())
    return torch.cat(tensor_list, dim=last_dim).contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, input_is_parallel=False):
        super().__init__()
        world_size = dist.get_world_size(group=get_tensor_model_parallel_group())
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // world_size))
        self.bias = nn.Parameter(torch.empty(output_size))

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = _ScatterToModelParallelRegion.apply(input_)
        output_ = _ReduceFromModelParallelRegion.apply(torch.matmul(input_parallel, self.weight.t()))
        return output_ + self.bias, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, gather_output=True):
        super().__init__()
        world_size = dist.get_world_size(group=get_tensor_model_parallel_group())
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(output_size // world_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size // world_size))

    def forward(self, input_):
        input_parallel = _CopyToModelParallelRegion.apply(input_)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        if self.gather_output:
            output = _GatherFromModelParallelRegion.apply(output_parallel)
        else:
            output = output_parallel
        return output, None


class ClassificationHead(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(dist.get_world_size())
        self.dense = RowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=False)
        self.classifier = ColumnParallelLinear(HIDDEN, NUM_CLASSES, gather_output=True)

    def forward(self, hidden_states, labels):
        x, _ = self.dense(hidden_states)
        logits, _ = self.classifier(torch.tanh(x))                  # [s, b, classes]
        loss = F.cross_entropy(logits.view(-1, NUM_CLASSES), labels.view(-1))
        params = [self.dense.weight, self.dense.bias, self.classifier.weight, self.classifier.bias]
        return (loss, *torch.autograd.grad(loss, params))


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.classifier = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, hidden_states, labels):
        logits = self.classifier(torch.tanh(self.dense(hidden_states)))
        loss = F.cross_entropy(logits.reshape(-1, NUM_CLASSES), labels.reshape(-1))
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return ClassificationHead()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(6, 2, HIDDEN), "labels": torch.randint(0, NUM_CLASSES, (6, 2))}


PARAM_PLACEMENTS = {"dense.weight": scalify.Shard(1), "classifier.weight": scalify.Shard(0),
                    "classifier.bias": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(1), scalify.Replicate(), scalify.Shard(0),
                     scalify.Shard(0)]
