"""Megatron-Core sequence-parallel MLP training step -- BUG: RowParallelLinear tags its weight
instead of its bias as sequence_parallel, so finalize_model_grads leaves the bias gradient
rank-partial and sums the two ranks' different weight-gradient shards."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
import scalify

STYLE = "megatron_core"
STEP = "training"
WORLD_SIZE = 2
BUG = 'RowParallelLinear sets the sequence_parallel attribute on its weight instead of its bias, so the bias gradient is not all-reduced over the TP group and the sharded weight gradients are wrongly summed.'


@dataclass
class TransformerConfig:
    hidden_size: int = 16
    ffn_hidden_size: int = 32
    tensor_model_parallel_size: int = 2
    sequence_parallel: bool = True
    layernorm_epsilon: float = 1e-6


CONFIG = TransformerConfig()
_TP_GROUP = None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        world_size = dist.get_world_size(_TP_GROUP)
        output = input_.new_empty((input_.size(0) * world_size, *input_.shape[1:]))
        dist.all_gather_into_tensor(output, input_.contiguous(), group=_TP_GROUP)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return _ReduceScatterToSequenceParallelRegion.apply(grad_output)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        world_size = dist.get_world_size(_TP_GROUP)
        output = input_.new_empty((input_.size(0) // world_size, *input_.shape[1:]))
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=_TP_GROUP)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return _GatherFromSequenceParallelRegion.apply(grad_output)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps, config):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, config):
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.weight = nn.Parameter(torch.empty(output_size // tp, input_size))
        self.bias = nn.Parameter(torch.empty(output_size // tp))

    def forward(self, input_):
        total_input = _GatherFromSequenceParallelRegion.apply(input_)
        return F.linear(total_input, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, config):
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp))
        self.bias = nn.Parameter(torch.empty(output_size))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)  # BUG

    def forward(self, input_):
        output_parallel = torch.matmul(input_, self.weight.t())
        output_ = _ReduceScatterToSequenceParallelRegion.apply(output_parallel)
        return output_, self.bias


class MLPBlock(nn.Module):
    def __init__(self, config=CONFIG):
        super().__init__()
        global _TP_GROUP
        _TP_GROUP = dist.new_group(list(range(config.tensor_model_parallel_size)))
        self.config = config
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, config)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config)

    def finalize_model_grads(self):
        """_allreduce_layernorm_grads: sequence-parallel params saw only this rank's tokens."""
        if self.config.tensor_model_parallel_size > 1 and self.config.sequence_parallel:
            grads = [p.main_grad for p in self.parameters() if getattr(p, "sequence_parallel", False)]
            coalesced = _flatten_dense_tensors(grads)
            dist.all_reduce(coalesced, group=_TP_GROUP)
            for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
                buf.copy_(synced)

    def forward(self, hidden_states, labels):
        residual = hidden_states
        x = self.pre_mlp_layernorm(hidden_states)
        x, _ = self.linear_fc1(x)
        x = F.gelu(x)
        x, bias = self.linear_fc2(x)
        output = residual + (x + bias)
        numel = output.numel() * dist.get_world_size(_TP_GROUP)
        loss = ((output - labels) ** 2).sum() / numel
        params = list(self.parameters())
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.main_grad = g.clone()
        self.finalize_model_grads()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=_TP_GROUP)
        return (reported, *[p.main_grad for p in params])


class Reference(nn.Module):
    def __init__(self, config=CONFIG):
        super().__init__()
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config)
        self.linear_fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, hidden_states, labels):
        x = self.linear_fc2(F.gelu(self.linear_fc1(self.pre_mlp_layernorm(hidden_states))))
        loss = F.mse_loss(hidden_states + x, labels)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return MLPBlock()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(8, 2, CONFIG.hidden_size), "labels": torch.randn(8, 2, CONFIG.hidden_size)}


PARAM_PLACEMENTS = {"linear_fc1.weight": scalify.Shard(0), "linear_fc1.bias": scalify.Shard(0),
                    "linear_fc2.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0), "labels": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Replicate(), scalify.Shard(0), scalify.Shard(0),
                     scalify.Shard(1), scalify.Replicate()]
