"""Tensor-parallel GPT-2, one rank: HuggingFace's GPT2LMHeadModel op for op, with Megatron-sharded Conv1D layers.

Module and parameter names equal HuggingFace's (lm_head is tied to transformer.wte as in HF).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GPT2Config
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from scalify.errors import ConfigError
from scalify.parallel.cross_entropy import VocabParallelCrossEntropy
from scalify.parallel.layers import (
    ParallelCausalLM,
    ColumnParallelConv1D,
    RowParallelConv1D,
    VocabParallelEmbedding,
    divide,
)

PAST_SEEN_TOKENS = 0  # no KV cache: positions start at 0, as in HF without past_key_values


class ParallelGPT2Attention(nn.Module):
    """GPT2Attention over this rank's heads: c_attn holds [q_r | k_r | v_r], c_proj sums the ranks."""

    def __init__(self, config: GPT2Config, layer_idx: int, world_size: int, parts: GPT2Parts) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        self.num_heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
        self.head_dim = embed_dim // config.num_attention_heads
        self.split_size = self.num_heads * self.head_dim
        self.num_heads_global = config.num_attention_heads

        self.scaling = 1.0
        if config.scale_attn_weights:
            self.scaling = self.head_dim**-0.5
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)

        self.c_attn = ColumnParallelConv1D(3 * embed_dim, embed_dim, world_size, blocks=3)
        self.c_proj = parts.attn_c_proj(embed_dim, embed_dim, world_size)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def split_heads(self, states: torch.Tensor) -> torch.Tensor:
        """The [batch, heads, seq, head_dim] view of projected states."""
        return states.view(*states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
        key_states = self.split_heads(key_states)
        value_states = self.split_heads(value_states)
        query_states = self.split_heads(query_states)

        attn_output, _ = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attn_dropout.p if self.training else 0.0,
            scaling=self.scaling,
        )

        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)
        return attn_output


class ParallelGPT2MLP(nn.Module):
    """GPT2MLP with a column-parallel c_fc and a row-parallel c_proj."""

    def __init__(self, intermediate_size: int, config: GPT2Config, world_size: int) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = ColumnParallelConv1D(intermediate_size, embed_dim, world_size)
        self.c_proj = RowParallelConv1D(embed_dim, intermediate_size, world_size)
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


class ParallelGPT2Block(nn.Module):
    """GPT2Block: replicated layer norms and residuals around the parallel attention and MLP."""

    def __init__(self, config: GPT2Config, layer_idx: int, world_size: int, parts: GPT2Parts) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = parts.attention(config, layer_idx, world_size, parts)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = ParallelGPT2MLP(inner_dim, config, world_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states, attention_mask=attention_mask)
        hidden_states = attn_output + residual

        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states
        return hidden_states


class ParallelGPT2Model(nn.Module):
    """GPT2Model with a vocab-parallel wte and replicated wpe; returns the final (replicated) hidden states."""

    def __init__(self, config: GPT2Config, rank: int, world_size: int, parts: GPT2Parts) -> None:
        super().__init__()
        self.config = config
        self.wte = parts.embedding(config.vocab_size, config.hidden_size, rank, world_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(
            [ParallelGPT2Block(config, i, world_size, parts) for i in range(config.num_hidden_layers)]
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]

        inputs_embeds = self.wte(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + PAST_SEEN_TOKENS
        position_ids = position_ids.unsqueeze(0)
        position_embeds = self.wpe(position_ids)
        hidden_states = inputs_embeds + position_embeds.to(inputs_embeds.device)

        attention_mask = attention_mask.view(batch_size, -1)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )

        hidden_states = self.drop(hidden_states)
        output_shape = (-1,) + input_shape[1:] + (hidden_states.size(-1),)

        for block in self.h:
            hidden_states = block(hidden_states, causal_mask)

        hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(output_shape)
        return hidden_states


@dataclass(frozen=True)
class GPT2Parts:
    """The layer classes a GPT-2 rank is assembled from; a planted bug swaps one of them."""

    embedding: type[VocabParallelEmbedding] = VocabParallelEmbedding
    attention: type[ParallelGPT2Attention] = ParallelGPT2Attention
    attn_c_proj: type[RowParallelConv1D] = RowParallelConv1D


def build_gpt2_rank(
    config: GPT2Config, rank: int, world_size: int, parts: GPT2Parts, *, gather_logits: bool
) -> ParallelCausalLM:
    """Rank `rank` of the tensor-parallel GPT-2 (built on the current default device)."""
    if config.reorder_and_upcast_attn or config.add_cross_attention:
        raise ConfigError("gpt2: reorder_and_upcast_attn and add_cross_attention are not supported in parallel")
    divide(config.vocab_size, world_size, "vocab_size")
    backbone = ParallelGPT2Model(config, rank, world_size, parts)
    return ParallelCausalLM("transformer", backbone, backbone.wte, config.n_embd, config.vocab_size,
                            world_size, tie=config.tie_word_embeddings, gather_logits=gather_logits,
                            vocab_parallel_loss=VocabParallelCrossEntropy())
