"""LLaMA (fairscale model parallel) FFN sub-block training step; BUG: copy_to_model_parallel_region's
backward returns the gradient without all-reducing it, so the replicated ffn_norm weight only
gets the gradient flowing through this rank's column shard."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "training"
WORLD_SIZE = 2
BUG = "_CopyToModelParallelRegion.backward does not all-reduce the input gradient over the model parallel group, so the ffn_norm weight gradient is partial."

DIM, MULTIPLE_OF, NORM_EPS = 16, 16, 1e-5

# ---- fairscale.nn.model_parallel.initialize / mappings (imitation) ----
_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(model_parallel_size):
    global _MODEL_PARALLEL_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    for i in range(world // model_parallel_size):
        ranks = list(range(i * model_parallel_size, (i + 1) * model_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP = group


def get_model_parallel_group():
    return _MODEL_PARALLEL_GROUP


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


def _reduce(ctx, input_):
    group = get_model_parallel_group()
    if dist.get_world_size(group=group) == 1:
        return input_
    dist.all_reduce(input_, group=group)
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output  # BUG


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(ctx, input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


# ---- fairscale.nn.model_parallel.layers (imitation) ----
class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, gather_output=True, init_method=lambda x: x):
        super().__init__()
        self.output_size_per_partition = out_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        assert not bias and not gather_output
        self.bias = None

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        return F.linear(input_parallel, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, input_is_parallel=False, init_method=lambda x: x):
        super().__init__()
        self.input_size_per_partition = in_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        assert not bias and input_is_parallel

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        return reduce_from_model_parallel_region(output_parallel)


# ---- llama/model.py (imitation) ----
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


def ffn_hidden_dim(dim, multiple_of):
    hidden_dim = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, parallel):
        super().__init__()
        if parallel:
            self.w1 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False)
            self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, input_is_parallel=True)
            self.w3 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False)
        else:
            self.w1 = nn.Linear(dim, hidden_dim, bias=False)
            self.w2 = nn.Linear(hidden_dim, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FFNBlock(nn.Module):
    def __init__(self, parallel):
        super().__init__()
        self.feed_forward = FeedForward(DIM, ffn_hidden_dim(DIM, MULTIPLE_OF), parallel)
        self.ffn_norm = RMSNorm(DIM, eps=NORM_EPS)

    def forward(self, x, target):
        h = x + self.feed_forward(self.ffn_norm(x))
        loss = F.mse_loss(h, target)
        params = [self.ffn_norm.weight, self.feed_forward.w1.weight,
                  self.feed_forward.w2.weight, self.feed_forward.w3.weight]
        return (loss, *torch.autograd.grad(loss, params))


def reference():
    return FFNBlock(parallel=False)


def rank_module(rank, world_size):
    initialize_model_parallel(world_size)
    return FFNBlock(parallel=True)


def inputs():
    return {"x": torch.randn(2, 5, DIM), "target": torch.randn(2, 5, DIM)}


PARAM_PLACEMENTS = {"feed_forward.w1.weight": scalify.Shard(0), "feed_forward.w2.weight": scalify.Shard(1),
                    "feed_forward.w3.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Replicate(), scalify.Shard(0), scalify.Shard(1),
                     scalify.Shard(0)]
