"""Megatron-Core-style TP=2 MLP training step on a micro-batch of one ([s, b=1, h]): replicated
LayerNorm, ColumnParallelLinear + gelu + RowParallelLinear (bias added after the all-reduce),
MSE loss, then clip_grad_norm as in megatron/core/optimizer/clip_grads.py."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "megatron_core"
STEP = "training"
WORLD_SIZE = 2
BUG = None

HIDDEN, FFN, SEQ, MICRO_BATCH = 8, 16, 4, 1
MAX_NORM = 0.05

_TP_GROUP = None


def get_tensor_model_parallel_group():
    return _TP_GROUP


def get_tensor_model_parallel_rank():
    return dist.get_rank(group=_TP_GROUP)


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=_TP_GROUP)


def _reduce(input_):
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_.contiguous(), group=get_tensor_model_parallel_group())
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


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=False):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = output_size // world_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, input_):
        input_parallel = _CopyToModelParallelRegion.apply(input_)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        return output_parallel, None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, skip_bias_add=True):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size // world_size
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None  # a TP duplicate

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        output_ = _ReduceFromModelParallelRegion.apply(output_parallel)
        if not self.skip_bias_add:
            return output_ + self.bias, None
        return output_, self.bias


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN)
        self.linear_fc2 = RowParallelLinear(FFN, HIDDEN, skip_bias_add=True)

    def forward(self, hidden_states):
        intermediate, _ = self.linear_fc1(hidden_states)
        intermediate = F.gelu(intermediate)
        output, output_bias = self.linear_fc2(intermediate)
        return output, output_bias


def param_is_not_tensor_parallel_duplicate(param):
    return (hasattr(param, "tensor_model_parallel") and param.tensor_model_parallel) or (
        get_tensor_model_parallel_rank() == 0)


@torch.no_grad()
def clip_grad_norm_fp32(params, grads, max_norm, norm_type=2.0):
    """megatron.core.optimizer.clip_grads: get_grad_norm_fp32 + clip_grad_by_total_norm_fp32."""
    grads_for_norm = [g for p, g in zip(params, grads) if param_is_not_tensor_parallel_duplicate(p)]
    total_norm = torch.zeros(())
    for grad in grads_for_norm:
        grad_norm = torch.norm(grad, norm_type)
        total_norm = total_norm + grad_norm ** norm_type
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=get_tensor_model_parallel_group())
    total_norm = total_norm ** (1.0 / norm_type)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    clip_coeff = torch.clamp(clip_coeff, max=1.0)
    return [g * clip_coeff for g in grads], total_norm


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, hidden_states, target):
        ln_out = self.pre_mlp_layernorm(hidden_states)
        output, output_bias = self.mlp(ln_out)
        if output_bias is not None:
            output = output + output_bias  # bias_dropout_add, dropout off
        loss = F.mse_loss(output, target)
        params = list(self.parameters())
        grads = torch.autograd.grad(loss, params)
        grads, _ = clip_grad_norm_fp32(params, grads, MAX_NORM)
        return (loss, *grads)


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(HIDDEN, FFN)
        self.mlp.linear_fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, hidden_states, target):
        h = self.pre_mlp_layernorm(hidden_states)
        out = self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(h)))
        loss = F.mse_loss(out, target)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        total_norm = torch.stack([g.norm(2) for g in grads]).norm(2)
        coeff = torch.clamp(MAX_NORM / (total_norm + 1.0e-6), max=1.0)
        return (loss, *[g * coeff for g in grads])


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    global _TP_GROUP
    _TP_GROUP = dist.new_group(list(range(world_size)))
    return TrainStep()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, MICRO_BATCH, HIDDEN),
            "target": torch.randn(SEQ, MICRO_BATCH, HIDDEN)}


PARAM_PLACEMENTS = {
    "mlp.linear_fc1.weight": scalify.Shard(0),
    "mlp.linear_fc1.bias": scalify.Shard(0),
    "mlp.linear_fc2.weight": scalify.Shard(1),
}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [
    scalify.Replicate(),   # loss
    scalify.Replicate(),   # pre_mlp_layernorm.weight grad
    scalify.Replicate(),   # pre_mlp_layernorm.bias grad
    scalify.Shard(0),      # linear_fc1.weight grad
    scalify.Shard(0),      # linear_fc1.bias grad
    scalify.Shard(1),      # linear_fc2.weight grad
    scalify.Replicate(),   # linear_fc2.bias grad
]
