"""nanotron Llama CausalSelfAttention under tensor parallelism (ALL_REDUCE mode) on [s, b, h]: fused
qkv_proj TensorParallelColumnLinear whose shard holds contiguous_chunks (q, k, v) of this rank's
heads, GQA (4 query heads, 2 kv heads), interleaved rotary embedding from position_ids, causal SDPA,
and o_proj TensorParallelRowLinear with differentiable_all_reduce_sum."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "nanotron"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, N_HEADS, N_KV_HEADS, SEQ = 16, 4, 2, 8
D_QK = HIDDEN // N_HEADS


class ParallelContext:
    def __init__(self, tensor_parallel_size):
        ranks = torch.arange(dist.get_world_size()).reshape(1, -1, tensor_parallel_size)
        self.tp_pg = self.create_new_group(ranks.reshape(-1, tensor_parallel_size))

    def create_new_group(self, all_groups_ranks):
        mine = None
        for group_ranks in all_groups_ranks.tolist():
            new_group = dist.new_group(ranks=group_ranks)
            if dist.get_rank() in group_ranks:
                mine = new_group
        return mine


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
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableIdentity.apply(grad_output, ctx.group), None


def differentiable_identity(tensor, group=None):
    return DifferentiableIdentity.apply(tensor, group)


def differentiable_all_reduce_sum(tensor, group=None):
    return DifferentiableAllReduceSum.apply(tensor, group)


class RotaryEmbedding(nn.Module):
    """Interleaved rotary: pairs (x[2i], x[2i+1]) are rotated together."""

    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2) / dim), persistent=False)

    def forward(self, x, position_ids):
        # x: [batch_size, seq_length, num_heads, d_qk]; position_ids: [batch_size, seq_length]
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)   # [b, s, d/2]
        cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]
        x = x.view(*x.shape[:-1], self.dim // 2, 2)
        x_even, x_odd = x[..., 0], x[..., 1]
        out = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
        return out.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, tp_pg):
        super().__init__()
        self.tp_pg = tp_pg
        tp = dist.get_world_size(tp_pg)
        self.n_local_q_heads = N_HEADS // tp
        self.n_local_kv_heads = N_KV_HEADS // tp
        self.n_repeats = N_HEADS // N_KV_HEADS
        q_size, kv_size = N_HEADS * D_QK, N_KV_HEADS * D_QK
        self.qkv_proj = nn.Linear(HIDDEN, (q_size + 2 * kv_size) // tp, bias=False)  # contiguous_chunks
        self.o_proj = nn.Linear(q_size // tp, HIDDEN, bias=False)
        self.rotary_embedding = RotaryEmbedding(D_QK)

    def forward(self, hidden_states, position_ids):
        # hidden_states: [seq_length, batch_size, hidden_size]
        qkv_states = F.linear(differentiable_identity(hidden_states, group=self.tp_pg), self.qkv_proj.weight)
        q_length, batch_size, _ = qkv_states.shape
        query_states, key_states, value_states = torch.split(
            qkv_states, [self.n_local_q_heads * D_QK, self.n_local_kv_heads * D_QK,
                         self.n_local_kv_heads * D_QK], dim=-1)
        query_states = query_states.transpose(0, 1).contiguous().view(batch_size, q_length, self.n_local_q_heads, D_QK)
        key_states = key_states.transpose(0, 1).contiguous().view(batch_size, q_length, self.n_local_kv_heads, D_QK)
        value_states = value_states.transpose(0, 1).contiguous().view(batch_size, q_length, self.n_local_kv_heads, D_QK)
        query_states = self.rotary_embedding(query_states, position_ids=position_ids)
        key_states = self.rotary_embedding(key_states, position_ids=position_ids)
        # [b, s, n, d] -> [b, n, s, d]; expand kv heads for GQA
        key_states = key_states.repeat_interleave(self.n_repeats, dim=2)
        value_states = value_states.repeat_interleave(self.n_repeats, dim=2)
        attention_output = F.scaled_dot_product_attention(
            query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2),
            is_causal=True, scale=1.0 / math.sqrt(D_QK))
        attention_output = attention_output.permute(2, 0, 1, 3).reshape(q_length, batch_size, -1)
        output = F.linear(attention_output, self.o_proj.weight)
        return differentiable_all_reduce_sum(output, group=self.tp_pg)


class ReferenceAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, N_HEADS * D_QK, bias=False)
        self.k_proj = nn.Linear(HIDDEN, N_KV_HEADS * D_QK, bias=False)
        self.v_proj = nn.Linear(HIDDEN, N_KV_HEADS * D_QK, bias=False)
        self.o_proj = nn.Linear(N_HEADS * D_QK, HIDDEN, bias=False)
        self.rotary_embedding = RotaryEmbedding(D_QK)

    def forward(self, hidden_states, position_ids):
        x = hidden_states.transpose(0, 1)                  # [b, s, h]
        b, s, _ = x.shape
        q = self.rotary_embedding(self.q_proj(x).view(b, s, N_HEADS, D_QK), position_ids)
        k = self.rotary_embedding(self.k_proj(x).view(b, s, N_KV_HEADS, D_QK), position_ids)
        v = self.v_proj(x).view(b, s, N_KV_HEADS, D_QK)
        k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=2)
        v = v.repeat_interleave(N_HEADS // N_KV_HEADS, dim=2)
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(D_QK)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("bnqk,bknd->qbnd", probs, v).reshape(s, b, -1)
        return self.o_proj(out)


def reference() -> nn.Module:
    return ReferenceAttention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return CausalSelfAttention(ParallelContext(tensor_parallel_size=world_size).tp_pg)


def shard(state, rank, world_size):
    q, k, v = (state[f"{n}_proj.weight"].chunk(world_size, 0)[rank] for n in "qkv")
    return {"qkv_proj.weight": torch.cat([q, k, v], dim=0),
            "o_proj.weight": state["o_proj.weight"].chunk(world_size, 1)[rank].clone()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, 2, HIDDEN),
            "position_ids": torch.arange(SEQ).unsqueeze(0).repeat(2, 1)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
