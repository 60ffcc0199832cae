"""fairscale / Megatron-LM v1 mpu-style model-parallel (size 2) MLP training step:
ColumnParallelLinear(gather_output=False) + RowParallelLinear(input_is_parallel=True) on
[tokens, hidden], MSE loss, then mpu.clip_grad_norm (norm_type 2) over the model-parallel group."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "fairscale"
STEP = "training"
WORLD_SIZE = 2
BUG = None

HIDDEN, FFN, TOKENS = 8, 16, 4
MAX_NORM = 0.05

_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(model_parallel_size: int) -> None:
    global _MODEL_PARALLEL_GROUP
    world_size = dist.get_world_size()
    for i in range(world_size // model_parallel_size):
        ranks = list(range(i * model_parallel_size, (i + 1) * model_parallel_size))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            _MODEL_PARALLEL_GROUP = group


def get_model_parallel_group():
    return _MODEL_PARALLEL_GROUP


def get_model_parallel_rank():
    return dist.get_rank(group=_MODEL_PARALLEL_GROUP)


def get_model_parallel_world_size():
    return dist.get_world_size(group=_MODEL_PARALLEL_GROUP)


def _reduce(input_):
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
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, gather_output=True):
        super().__init__()
        assert not gather_output, "this case keeps the output partitioned"
        self.output_size_per_partition = out_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        self.weight.model_parallel = True
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
        self.bias.model_parallel = True

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        return F.linear(input_parallel, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, input_is_parallel=False):
        super().__init__()
        assert input_is_parallel, "this case feeds the column-parallel output straight in"
        self.input_size_per_partition = in_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        self.weight.model_parallel = True
        self.bias = nn.Parameter(torch.zeros(out_features))  # replicated: no model_parallel

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        output_ = reduce_from_model_parallel_region(output_parallel)
        return output_ + self.bias


@torch.no_grad()
def clip_grad_norm(parameters, max_norm, norm_type=2):
    """mpu.clip_grad_norm for a finite norm_type, kept on tensors (no .item())."""
    parameters = [p for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    total_norm = torch.zeros(())
    for p in parameters:
        if getattr(p, "model_parallel", False) or get_model_parallel_rank() == 0:
            param_norm = p.grad.norm(norm_type)
            total_norm = total_norm + param_norm ** norm_type
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=get_model_parallel_group())
    total_norm = total_norm ** (1.0 / norm_type)
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef = torch.clamp(clip_coef, max=1.0)  # `if clip_coef < 1: mul_`, data independent
    for p in parameters:
        p.grad.mul_(clip_coef)
    return total_norm


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(HIDDEN, FFN, gather_output=False)
        self.dense_4h_to_h = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)

    def forward(self, x, target):
        out = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))
        loss = F.mse_loss(out, target)
        params = list(self.parameters())
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.grad = g
        clip_grad_norm(params, MAX_NORM)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return (loss, *grads)


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN, FFN)
        self.dense_4h_to_h = nn.Linear(FFN, HIDDEN)

    def forward(self, x, target):
        loss = F.mse_loss(self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x))), target)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        total_norm = torch.stack([g.norm(2) for g in grads]).norm(2)
        clip_coef = torch.clamp(MAX_NORM / (total_norm + 1e-6), max=1.0)
        return (loss, *[g * clip_coef for g in grads])


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    initialize_model_parallel(world_size)
    return TrainStep()


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(TOKENS, HIDDEN), "target": torch.randn(TOKENS, HIDDEN)}


PARAM_PLACEMENTS = {
    "dense_h_to_4h.weight": scalify.Shard(0),
    "dense_h_to_4h.bias": scalify.Shard(0),
    "dense_4h_to_h.weight": scalify.Shard(1),
}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [
    scalify.Replicate(),   # loss
    scalify.Shard(0),      # dense_h_to_4h.weight grad
    scalify.Shard(0),      # dense_h_to_4h.bias grad
    scalify.Shard(1),      # dense_4h_to_h.weight grad
    scalify.Replicate(),   # dense_4h_to_h.bias grad
]
