"""nanotron Llama decoder MLP half in TensorParallelLinearMode.ALL_REDUCE on [s, b, h]:
RMSNorm -> gate_up_proj (TensorParallelColumnLinear, contiguous_chunks) -> split SiLU-mul ->
down_proj (TensorParallelRowLinear, differentiable_all_reduce_sum) -> residual."""
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "nanotron"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, INTERMEDIATE = 16, 32


class ParallelContext:
    def __init__(self, tensor_parallel_size, pipeline_parallel_size=1, data_parallel_size=1):
        world_size = dist.get_world_size()
        assert world_size == tensor_parallel_size * pipeline_parallel_size * data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        ranks = torch.arange(world_size).reshape(pipeline_parallel_size, data_parallel_size, tensor_parallel_size)
        self.world_rank_matrix = ranks
        self.tp_pg = self.create_new_group(ranks.reshape(-1, tensor_parallel_size))
        self.dp_pg = self.create_new_group(ranks.transpose(1, 2).reshape(-1, data_parallel_size))

    def create_new_group(self, all_groups_ranks):
        rank, new_group_containing_rank = dist.get_rank(), None
        for group_ranks in all_groups_ranks.tolist():
            new_group = dist.new_group(ranks=group_ranks)
            if rank in group_ranks:
                new_group_containing_rank = new_group
        return new_group_containing_rank


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


class DifferentiableIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableAllReduceSum.apply(grad_output, ctx.group), None


class DifferentiableAllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        if dist.get_world_size(group) == 1:
            return tensor
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableIdentity.apply(grad_output, ctx.group), None


def differentiable_identity(tensor, group=None):
    return DifferentiableIdentity.apply(tensor, group)


def differentiable_all_reduce_sum(tensor, group=None):
    return DifferentiableAllReduceSum.apply(tensor, group)


def column_linear(input, weight, bias, group, tp_mode):
    if tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        input = differentiable_identity(input, group=group)
    else:
        raise ValueError(f"Got unexpected mode: {tp_mode}.")
    return F.linear(input, weight, bias)


def row_linear(input, weight, bias, group, tp_mode):
    out = F.linear(input, weight, bias)
    if tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        out = differentiable_all_reduce_sum(out, group=group)
    else:
        raise ValueError(f"Got unexpected mode: {tp_mode}.")
    return out


class TensorParallelColumnLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=True, contiguous_chunks=None):
        self.pg, self.mode = pg, mode
        self.contiguous_chunks = contiguous_chunks
        super().__init__(in_features, out_features // dist.get_world_size(pg), bias=bias)

    def forward(self, x):
        return column_linear(x, self.weight, self.bias, group=self.pg, tp_mode=self.mode)


class TensorParallelRowLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=False):
        self.pg, self.mode = pg, mode
        super().__init__(in_features // dist.get_world_size(pg), out_features, bias=bias)

    def forward(self, x):
        return row_linear(x, self.weight, self.bias, group=self.pg, tp_mode=self.mode)


class GLUActivation(nn.Module):
    def forward(self, merged_states):
        gate_states, up_states = torch.split(merged_states, merged_states.shape[-1] // 2, dim=-1)
        return F.silu(gate_states) * up_states


class MLP(nn.Module):
    def __init__(self, tp_pg, tp_mode):
        super().__init__()
        self.gate_up_proj = TensorParallelColumnLinear(
            HIDDEN, 2 * INTERMEDIATE, pg=tp_pg, mode=tp_mode, bias=False,
            contiguous_chunks=(INTERMEDIATE, INTERMEDIATE))
        self.down_proj = TensorParallelRowLinear(INTERMEDIATE, HIDDEN, pg=tp_pg, mode=tp_mode, bias=False)
        self.split_silu_mul = GLUActivation()

    def forward(self, hidden_states):
        merged_states = self.gate_up_proj(hidden_states)
        hidden_states = self.down_proj(self.split_silu_mul(merged_states))
        return {"hidden_states": hidden_states}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaMLPBlock(nn.Module):
    def __init__(self, parallel_context):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP(parallel_context.tp_pg, TensorParallelLinearMode.ALL_REDUCE)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states=hidden_states)["hidden_states"]
        return hidden_states + residual


class ReferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, hidden_states):
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def reference() -> nn.Module:
    return ReferenceBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return LlamaMLPBlock(ParallelContext(tensor_parallel_size=world_size))


def shard(state, rank, world_size):
    gate = state["gate_proj.weight"].chunk(world_size, 0)[rank]
    up = state["up_proj.weight"].chunk(world_size, 0)[rank]
    return {"post_attention_layernorm.weight": state["post_attention_layernorm.weight"].clone(),
            "mlp.gate_up_proj.weight": torch.cat([gate, up], 0),
            "mlp.down_proj.weight": state["down_proj.weight"].chunk(world_size, 1)[rank].clone()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(6, 2, HIDDEN)}   # [seq_length, batch_size, hidden_size]


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
