"""Megatron-Core sequence-parallel MLP sub-layer on [s/tp, b, h]: pre_mlp_layernorm, linear_fc1
(ColumnParallelLinear, sequence_parallel, skip_bias_add, fused [gate; up] weight) with the
sequence all-gathered into it, bias_swiglu, linear_fc2 (RowParallelLinear) reduce-scattered back
along the sequence, then the fused bias-dropout-add with the residual."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "forward"
WORLD_SIZE = 2
BUG = None


@dataclass
class TransformerConfig:
    hidden_size: int = 16
    ffn_hidden_size: int = 24
    tensor_model_parallel_size: int = 2
    sequence_parallel: bool = True
    gated_linear_unit: bool = True
    add_bias_linear: bool = True
    hidden_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5


class parallel_state:
    _TENSOR_MODEL_PARALLEL_GROUP = None

    @classmethod
    def initialize_model_parallel(cls, tensor_model_parallel_size):
        world_size = dist.get_world_size()
        for i in range(world_size // tensor_model_parallel_size):
            ranks = list(range(i * tensor_model_parallel_size, (i + 1) * tensor_model_parallel_size))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                cls._TENSOR_MODEL_PARALLEL_GROUP = group

    @classmethod
    def get_tensor_model_parallel_group(cls):
        return cls._TENSOR_MODEL_PARALLEL_GROUP


def _gather_along_first_dim(input_):
    group = parallel_state.get_tensor_model_parallel_group()
    world_size = dist.get_world_size(group)
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_first_dim(input_):
    group = parallel_state.get_tensor_model_parallel_group()
    world_size = dist.get_world_size(group)
    dim_size = list(input_.size())
    assert dim_size[0] % world_size == 0
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
    return output


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_first_dim(grad_output)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, *, config, bias=True, skip_bias_add=False):
        super().__init__()
        self.config = config
        out_per_partition = output_size // config.tensor_model_parallel_size
        self.weight = nn.Parameter(torch.empty(out_per_partition, input_size))
        self.bias = nn.Parameter(torch.zeros(out_per_partition)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, input_):
        if self.config.sequence_parallel:
            input_parallel = _GatherFromSequenceParallelRegion.apply(input_)
        else:
            raise NotImplementedError
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = F.linear(input_parallel, self.weight, bias)
        return output_parallel, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, *, config, bias=True, skip_bias_add=False):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(output_size, input_size // config.tensor_model_parallel_size))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        output_ = _ReduceScatterToSequenceParallelRegion.apply(output_parallel)
        if not self.skip_bias_add:
            return output_ + self.bias, None
        return output_, self.bias


def bias_swiglu_impl(y, bias):
    y = y + bias
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def bias_dropout_add(x_with_bias, residual, prob, training):
    x, bias = x_with_bias
    out = F.dropout(x + bias, p=prob, training=training)
    return residual + out


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        ffn = config.ffn_hidden_size * 2 if config.gated_linear_unit else config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, ffn, config=config, skip_bias_add=True)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                            skip_bias_add=True)

    def forward(self, hidden_states):
        intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)
        intermediate_parallel = bias_swiglu_impl(intermediate_parallel, bias_parallel)
        return self.linear_fc2(intermediate_parallel)


class TransformerLayerMLPPart(nn.Module):
    def __init__(self, config=TransformerConfig()):
        super().__init__()
        parallel_state.initialize_model_parallel(config.tensor_model_parallel_size)
        self.config = config
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states):
        residual = hidden_states
        pre_mlp_layernorm_output = self.pre_mlp_layernorm(hidden_states)
        mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output)
        return bias_dropout_add(mlp_output_with_bias, residual, self.config.hidden_dropout, self.training)


class Reference(nn.Module):
    def __init__(self, config=TransformerConfig()):
        super().__init__()
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size)
        self.mlp.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        gate, up = self.mlp.linear_fc1(self.pre_mlp_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.mlp.linear_fc2(F.silu(gate) * up)


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return TransformerLayerMLPPart()


def shard(state, rank, world_size):
    out = {k: v.clone() for k, v in state.items() if k.startswith("pre_mlp_layernorm")}
    for suffix in ("weight", "bias"):
        gate, up = state[f"mlp.linear_fc1.{suffix}"].chunk(2, dim=0)
        out[f"mlp.linear_fc1.{suffix}"] = torch.cat([gate.chunk(world_size, 0)[rank],
                                                     up.chunk(world_size, 0)[rank]], dim=0)
    out["mlp.linear_fc2.weight"] = state["mlp.linear_fc2.weight"].chunk(world_size, 1)[rank].clone()
    out["mlp.linear_fc2.bias"] = state["mlp.linear_fc2.bias"].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(8, 2, 16)}   # [s, b, h]


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
