"""nanotron REDUCE_SCATTER-mode Llama MLP training step -- BUG: DifferentiableAllGather.backward
just takes this rank's slice of the gradient instead of reduce-scattering it, dropping the other
ranks' contributions to this rank's sequence shard."""
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "nanotron"
STEP = "training"
WORLD_SIZE = 2
BUG = "DifferentiableAllGather.backward returns this rank's slice of grad_output instead of a reduce-scatter sum, so the other TP ranks' gradient contributions to the local sequence shard are lost."

HIDDEN, INTERMEDIATE, SEQ = 16, 24, 8


class ParallelContext:
    def __init__(self, tensor_parallel_size, data_parallel_size=1):
        ranks = torch.arange(dist.get_world_size()).reshape(1, data_parallel_size, tensor_parallel_size)
        self.tp_pg = self.create_new_group(ranks.reshape(-1, tensor_parallel_size))
        self.dp_pg = self.create_new_group(ranks.transpose(1, 2).reshape(-1, data_parallel_size))

    def create_new_group(self, all_groups_ranks):
        rank, mine = dist.get_rank(), None
        for group_ranks in all_groups_ranks.tolist():
            new_group = dist.new_group(ranks=group_ranks)
            if rank in group_ranks:
                mine = new_group
        return mine


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


class DifferentiableAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        unsharded_tensor = torch.empty(tensor.shape[0] * world_size, *tensor.shape[1:],
                                       dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(unsharded_tensor, tensor, group=group)
        return unsharded_tensor

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None  # BUG


class DifferentiableReduceScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return tensor
        assert tensor.shape[0] % world_size == 0
        tensor = tensor.contiguous()
        sharded_tensor = torch.empty(tensor.shape[0] // world_size, *tensor.shape[1:],
                                     dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_tensor(sharded_tensor, tensor, op=dist.ReduceOp.SUM, group=group)
        return sharded_tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableAllGather.apply(grad_output, ctx.group), None


def differentiable_all_gather(tensor, group=None):
    return DifferentiableAllGather.apply(tensor, group)


def differentiable_reduce_scatter_sum(tensor, group=None):
    return DifferentiableReduceScatterSum.apply(tensor, group)


class TensorParallelColumnLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=False, contiguous_chunks=None):
        self.pg, self.mode, self.contiguous_chunks = pg, mode, contiguous_chunks
        super().__init__(in_features, out_features // dist.get_world_size(pg), bias=bias)
        self.weight.is_sharded = True

    def forward(self, x):
        assert self.mode is TensorParallelLinearMode.REDUCE_SCATTER
        return F.linear(differentiable_all_gather(x, group=self.pg), self.weight, self.bias)


class TensorParallelRowLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=False):
        self.pg, self.mode = pg, mode
        super().__init__(in_features // dist.get_world_size(pg), out_features, bias=bias)
        self.weight.is_sharded = True

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return differentiable_reduce_scatter_sum(out, group=self.pg)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class LlamaMLPBlock(nn.Module):
    def __init__(self, parallel_context):
        super().__init__()
        self.tp_pg = parallel_context.tp_pg
        mode = TensorParallelLinearMode.REDUCE_SCATTER
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.gate_up_proj = TensorParallelColumnLinear(HIDDEN, 2 * INTERMEDIATE, pg=self.tp_pg, mode=mode,
                                                       contiguous_chunks=(INTERMEDIATE, INTERMEDIATE))
        self.down_proj = TensorParallelRowLinear(INTERMEDIATE, HIDDEN, pg=self.tp_pg, mode=mode)

    def forward(self, hidden_states, targets):
        # hidden_states, targets: [seq_length / tp, batch_size, hidden_size]
        x = self.post_attention_layernorm(hidden_states)
        gate_states, up_states = torch.split(self.gate_up_proj(x), self.gate_up_proj.out_features // 2, dim=-1)
        out = hidden_states + self.down_proj(F.silu(gate_states) * up_states)
        loss = F.mse_loss(out, targets, reduction="sum") / (out.numel() * dist.get_world_size(self.tp_pg))
        params = [self.post_attention_layernorm.weight, self.gate_up_proj.weight, self.down_proj.weight]
        grads = torch.autograd.grad(loss, params)
        handles = [dist.all_reduce(g, group=self.tp_pg, async_op=True)
                   for p, g in zip(params, grads) if not getattr(p, "is_sharded", False)]
        loss = loss.detach()
        handles.append(dist.all_reduce(loss, group=self.tp_pg, async_op=True))
        for handle in handles:
            handle.wait()
        gate_grad, up_grad = grads[1].chunk(2, dim=0)
        return loss, grads[0], gate_grad, up_grad, grads[2]


class ReferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, hidden_states, targets):
        x = self.post_attention_layernorm(hidden_states)
        out = hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        loss = F.mse_loss(out, targets)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    return ReferenceBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return LlamaMLPBlock(ParallelContext(tensor_parallel_size=world_size))


def shard(state, rank, world_size):
    gate = state["gate_proj.weight"].chunk(world_size, 0)[rank]
    up = state["up_proj.weight"].chunk(world_size, 0)[rank]
    return {"post_attention_layernorm.weight": state["post_attention_layernorm.weight"].clone(),
            "gate_up_proj.weight": torch.cat([gate, up], 0),
            "down_proj.weight": state["down_proj.weight"].chunk(world_size, 1)[rank].clone()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, 2, HIDDEN), "targets": torch.randn(SEQ, 2, HIDDEN)}


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0), "targets": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Replicate(), scalify.Shard(0), scalify.Shard(0),
                     scalify.Shard(1)]
