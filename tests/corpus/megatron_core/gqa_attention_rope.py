"""Megatron-Core SelfAttention with grouped-query attention and RoPE under tensor parallelism:
linear_qkv in the [ng, (np/ng + 2) * hn] layout split into [sq, b, np, hn] query and
[sq, b, ng, hn] key/value views, rotary embeddings, kv heads repeat_interleave'd in the core
attention, and linear_proj (RowParallelLinear, skip_bias_add) reduced over the TP group."""
import math
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
    hidden_size: int = 32
    num_attention_heads: int = 8
    num_query_groups: int = 4
    kv_channels: int = 4
    rotary_base: int = 10000
    tensor_model_parallel_size: int = 2


CONFIG = TransformerConfig()
_TP_GROUP = None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=_TP_GROUP)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class RotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_base):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, kv_channels, 2) / kv_channels))

    def forward(self, max_seq_len):
        seq = torch.arange(max_seq_len, device=self.inv_freq.device).to(torch.get_default_dtype())
        freqs = torch.outer(seq, self.inv_freq.to(seq.dtype))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]                       # [s, 1, 1, d]


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    return t * freqs.cos() + _rotate_half(t) * freqs.sin()


class SelfAttention(nn.Module):
    def __init__(self, config=CONFIG):
        super().__init__()
        global _TP_GROUP
        _TP_GROUP = dist.new_group(list(range(config.tensor_model_parallel_size)))
        tp = config.tensor_model_parallel_size
        self.config = config
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        qkv_size = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_size // tp, bias=False)  # ColumnParallelLinear
        self.linear_proj = nn.Linear(config.kv_channels * config.num_attention_heads // tp,
                                     config.hidden_size)                              # RowParallelLinear
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_base)

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv = self.linear_qkv(hidden_states)
        # [sq, b, hp] --> [sq, b, ng, (np/ng + 2) * hn]
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            (self.num_attention_heads_per_partition // self.num_query_groups_per_partition + 2)
            * self.hidden_size_per_attention_head)
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)
        split_arg_list = [
            self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            * self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head]
        (query, key, value) = torch.split(mixed_qkv, split_arg_list, dim=3)
        # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        return query, key, value

    def core_attention(self, query, key, value):
        # DotProductAttention with a causal mask; query [sq, b, np, hn], key/value [sk, b, ng, hn]
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        key = key.repeat_interleave(rep, dim=2)
        value = value.repeat_interleave(rep, dim=2)
        sq, sk = query.size(0), key.size(0)
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) / math.sqrt(self.hidden_size_per_attention_head)
        causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bnst,tbnd->sbnd", probs, value)
        return context.reshape(sq, context.size(1), -1)

    def forward(self, hidden_states):
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        rotary_pos_emb = self.rotary_pos_emb(hidden_states.size(0))
        query = apply_rotary_pos_emb(query, rotary_pos_emb)
        key = apply_rotary_pos_emb(key, rotary_pos_emb)
        core_attn_out = self.core_attention(query, key, value)
        output = _ReduceFromModelParallelRegion.apply(F.linear(core_attn_out, self.linear_proj.weight))
        bias = self.linear_proj.bias
        return output + bias


class Reference(nn.Module):
    """Single device, plain q/k/v projections ([np*hn], [ng*hn], [ng*hn] rows)."""

    def __init__(self, c=CONFIG):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.kv_channels, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_query_groups * c.kv_channels, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_query_groups * c.kv_channels, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.kv_channels, c.hidden_size)

    def forward(self, hidden_states):
        c = CONFIG
        s, b, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(s, b, c.num_attention_heads, c.kv_channels)
        k = self.k_proj(hidden_states).view(s, b, c.num_query_groups, c.kv_channels)
        v = self.v_proj(hidden_states).view(s, b, c.num_query_groups, c.kv_channels)
        inv = 1.0 / (c.rotary_base ** (torch.arange(0, c.kv_channels, 2) / c.kv_channels))
        freqs = torch.outer(torch.arange(s).to(q.dtype), inv.to(q.dtype))
        emb = torch.cat((freqs, freqs), -1)[:, None, None, :]
        q, k = apply_rotary_pos_emb(q, emb), apply_rotary_pos_emb(k, emb)
        rep = c.num_attention_heads // c.num_query_groups
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return SelfAttention()


def shard(state, rank, world_size):
    c = CONFIG
    ng, hn, rep = c.num_query_groups, c.kv_channels, c.num_attention_heads // c.num_query_groups
    q = state["q_proj.weight"].view(ng, rep * hn, -1)
    k = state["k_proj.weight"].view(ng, hn, -1)
    v = state["v_proj.weight"].view(ng, hn, -1)
    qkv = torch.cat([q, k, v], dim=1)                      # [ng, (rep + 2) * hn, h]
    local = qkv.chunk(world_size, dim=0)[rank]
    return {"linear_qkv.weight": local.reshape(-1, c.hidden_size).clone(),
            "linear_proj.weight": state["o_proj.weight"].chunk(world_size, 1)[rank].clone(),
            "linear_proj.bias": state["o_proj.bias"].clone()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(6, 2, CONFIG.hidden_size)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
