"""Tensor-parallel Llama with Megatron's fused layouts: one qkv_proj and one gate_up_proj per rank.

qkv_proj holds, for each kv group the rank serves, that group's query heads (the rank's share
of them) followed by the group's k and v heads; with fewer kv heads than ranks, each rank holds
one kv head, replicated over the ranks that share it. gate_up_proj holds [gate_r; up_r].
The reference (HF's LlamaForCausalLM) keeps q/k/v and gate/up separate, so these parameters
relate to several reference parameters: `shard_fused_llama` states how (scalify/parallel/sharding.py).
Both fused projections take their replicated input through Megatron's f, so in a training step
the input's gradient (partial on each rank) is all-reduced. A replicated kv head's rows get,
on each rank sharing it, only that rank's query heads' part of their gradient: `sync_grads`
sums them over the sharing ranks.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from scalify.parallel.layers import copy_to_tensor_parallel, divide, sum_over_rank_blocks
from scalify.parallel.llama import LlamaParts


def head_layout(config: LlamaConfig, world_size: int) -> tuple[int, int, int]:
    """(kv groups per rank, query heads per group on a rank, ranks sharing one kv group)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    local_heads = divide(heads, world_size, "num_attention_heads")
    if kv_heads >= world_size:
        groups = divide(kv_heads, world_size, "num_key_value_heads")
        return groups, local_heads // groups, 1
    sharing = divide(world_size, kv_heads, "tensor-parallel size over num_key_value_heads")
    return 1, local_heads, sharing


class FusedQKVLlamaAttention(nn.Module):
    """LlamaAttention over this rank's heads from one fused projection, split per kv group."""

    attention_function = staticmethod(eager_attention_forward)

    def __init__(self, config: LlamaConfig, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.groups, self.q_per_group, self.sharing = head_layout(config, world_size)
        self.num_key_value_groups = self.q_per_group
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        rows = self.groups * (self.q_per_group + 2) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, rows, bias=config.attention_bias)
        q_features = config.num_attention_heads * self.head_dim
        self.o_proj = parts.o_proj(q_features, config.hidden_size, world_size, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        grouped = self.qkv_proj(copy_to_tensor_parallel(hidden_states))
        grouped = grouped.view(*input_shape, self.groups, -1)
        query, key, value = grouped.split(
            [self.q_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        query_states = query.reshape(*input_shape, -1, self.head_dim).transpose(1, 2)
        key_states = key.reshape(*input_shape, -1, self.head_dim).transpose(1, 2)
        value_states = value.reshape(*input_shape, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = self.attention_function(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


    def sync_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """qkv_proj's gradients with the replicated kv rows summed over the ranks sharing them."""
        if self.sharing == 1:
            return {}
        q_rows = self.q_per_group * self.head_dim  # one kv group per rank when kv heads are shared
        return {name: torch.cat([grad[:q_rows], sum_over_rank_blocks(grad[q_rows:], self.sharing)])
                for name, grad in grads.items() if name.startswith("qkv_proj.")}


class FusedGateUpLlamaMLP(nn.Module):
    """LlamaMLP with one [gate_r; up_r] projection and a row-parallel down projection."""

    def __init__(self, config: LlamaConfig, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        local = divide(config.intermediate_size, world_size, "intermediate_size")
        self.gate_up_proj = nn.Linear(hidden, 2 * local, bias=bias)
        self.down_proj = parts.down_proj(config.intermediate_size, hidden, world_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(copy_to_tensor_parallel(x)).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


FUSED_PARTS = LlamaParts(attention=FusedQKVLlamaAttention, mlp=FusedGateUpLlamaMLP)
