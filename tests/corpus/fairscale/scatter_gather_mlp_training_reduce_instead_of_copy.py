"""fairscale model parallel MLP training step (gathered fc1 output, scattered fc2 input); BUG:
ColumnParallelLinear enters the parallel region with reduce_from_model_parallel_region instead
of copy_to_model_parallel_region, all-reducing its replicated input (tp_size x the input)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "training"
WORLD_SIZE = 2
BUG = "ColumnParallelLinear wraps its replicated input in reduce_from_model_parallel_region instead of copy_to_model_parallel_region, so the forward sums the identical inputs of all ranks."

HIDDEN, FFN = 12, 32


def get_model_parallel_group():
    return dist.group.WORLD


def get_model_parallel_rank():
    return dist.get_rank(group=get_model_parallel_group())


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


def _reduce(input_):
    if get_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_, group=get_model_parallel_group())
    return input_


def _split(input_):
    last_dim = input_.dim() - 1
    chunks = torch.split(input_, input_.size(last_dim) // get_model_parallel_world_size(), dim=last_dim)
    return chunks[get_model_parallel_rank()].contiguous()


def _gather(input_):
    tensor_list = [torch.empty_like(input_) for _ in range(get_model_parallel_world_size())]
    tensor_list[get_model_parallel_rank()] = input_
    dist.all_gather(tensor_list, input_, group=get_model_parallel_group())
    return torch.cat(tensor_list, dim=-1).contiguous()


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
        return _split(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split(grad_output)


copy_to_model_parallel_region = _CopyToModelParallelRegion.apply
reduce_from_model_parallel_region = _ReduceFromModelParallelRegion.apply
scatter_to_model_parallel_region = _ScatterToModelParallelRegion.apply
gather_from_model_parallel_region = _GatherFromModelParallelRegion.apply


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, gather_output=True):
        super().__init__()
        self.gather_output = gather_output
        self.output_size_per_partition = out_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition)) if bias else None

    def forward(self, input_):
        input_parallel = reduce_from_model_parallel_region(input_)  # BUG
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        if self.gather_output:
            return gather_from_model_parallel_region(output_parallel)
        return output_parallel


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, input_is_parallel=False):
        super().__init__()
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = in_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        output_ = reduce_from_model_parallel_region(output_parallel)
        return output_ + self.bias if self.bias is not None else output_


class MLP(nn.Module):
    def __init__(self, parallel):
        super().__init__()
        if parallel:
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, bias=True, gather_output=True)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, bias=True, input_is_parallel=False)
        else:
            self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x, target):
        y = self.fc2(F.gelu(self.fc1(x)))
        loss = ((y - target) ** 2).sum(dim=-1).mean()
        params = [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias]
        return (loss, *torch.autograd.grad(loss, params))


def reference():
    return MLP(parallel=False)


def rank_module(rank, world_size):
    return MLP(parallel=True)


def inputs():
    return {"x": torch.randn(2, 4, HIDDEN), "target": torch.randn(2, 4, HIDDEN)}


PARAM_PLACEMENTS = {"fc1.weight": scalify.Shard(0), "fc1.bias": scalify.Shard(0), "fc2.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(0), scalify.Shard(0), scalify.Shard(1), scalify.Replicate()]
