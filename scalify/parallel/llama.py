"""Tensor-parallel Llama, one rank: HuggingFace's LlamaForCausalLM op for op, with Megatron-sharded layers.

Module and parameter names equal HuggingFace's, so placements map by name. Head counts are local.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from scalify.errors import ShapeError
from scalify.parallel.cross_entropy import VocabParallelCrossEntropy
from scalify.parallel.layers import (
    ParallelCausalLM,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    divide,
)

PAST_SEEN_TOKENS = 0  # no KV cache: positions start at 0, as in HF without past_key_values


def kv_head_of_rank(rank: int, world_size: int, kv_heads: int) -> int:
    """The kv head rank `rank` needs when kv heads are fewer than ranks: its query heads' group."""
    return rank // (world_size // kv_heads)


def kv_sharding(
    config: LlamaConfig, world_size: int, head_of_rank: Callable[[int, int, int], int]
) -> tuple[int, tuple[int, ...] | None]:
    """(number of kv-head chunks, chunk held by each rank) for k_proj / v_proj.

    With at least as many kv heads as ranks, the kv heads are split like the query heads; with
    fewer, each rank holds the one kv head `head_of_rank` names (replicated over several ranks).
    """
    kv_heads = config.num_key_value_heads
    if kv_heads >= world_size:
        divide(kv_heads, world_size, "num_key_value_heads")
        return world_size, None
    if world_size % kv_heads != 0:
        raise ShapeError(
            f"tensor-parallel size {world_size} is not a multiple of num_key_value_heads ({kv_heads}): "
            "kv heads cannot be replicated evenly"
        )
    return kv_heads, tuple(head_of_rank(rank, world_size, kv_heads) for rank in range(world_size))


class ParallelLlamaAttention(nn.Module):
    """LlamaAttention over this rank's query heads and the kv heads they use; o_proj sums the ranks."""

    attention_function = staticmethod(eager_attention_forward)

    def __init__(self, config: LlamaConfig, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        num_heads = divide(config.num_attention_heads, world_size, "num_attention_heads")
        kv_chunks, kv_chunk_of_rank = kv_sharding(config, world_size, parts.kv_head_of_rank)
        self.num_key_value_groups = num_heads // (config.num_key_value_heads // kv_chunks)
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout

        q_features = config.num_attention_heads * self.head_dim
        kv_features = config.num_key_value_heads * self.head_dim
        bias, sp = config.attention_bias, parts.sequence_parallel_options()
        self.q_proj = parts.q_proj(config.hidden_size, q_features, world_size, bias=bias, **sp)
        self.k_proj = ColumnParallelLinear(
            config.hidden_size, kv_features, kv_chunks, bias=bias, chunk_of_rank=kv_chunk_of_rank, **sp
        )
        self.v_proj = ColumnParallelLinear(
            config.hidden_size, kv_features, kv_chunks, bias=bias, chunk_of_rank=kv_chunk_of_rank, **sp
        )
        self.o_proj = parts.o_proj(q_features, config.hidden_size, world_size, bias=bias, **sp)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_states = self.q_proj(hidden_states)
        input_shape = query_states.shape[:-1]  # the whole sequence, also under sequence parallelism
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = self.attention_function(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class ParallelLlamaMLP(nn.Module):
    """LlamaMLP with column-parallel gate/up and row-parallel down projections."""

    def __init__(self, config: LlamaConfig, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        hidden, intermediate, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        sp = parts.sequence_parallel_options()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, world_size, bias=bias, **sp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, world_size, bias=bias, **sp)
        self.down_proj = parts.down_proj(intermediate, hidden, world_size, bias=bias, **sp)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class ParallelLlamaDecoderLayer(nn.Module):
    """LlamaDecoderLayer: replicated norms and residuals around the parallel attention and MLP."""

    def __init__(self, config: LlamaConfig, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        self.self_attn = parts.attention(config, world_size, parts)
        self.mlp = parts.mlp(config, world_size, parts)
        self.input_layernorm = parts.norm()(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = parts.norm()(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class ParallelLlamaModel(nn.Module):
    """LlamaModel with a vocab-parallel embedding; returns the final (replicated) hidden states."""

    def __init__(self, config: LlamaConfig, rank: int, world_size: int, parts: LlamaParts) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = parts.embedding(config.vocab_size, config.hidden_size, rank, world_size,
                                            **parts.sequence_parallel_options())
        self.layers = nn.ModuleList(
            [ParallelLlamaDecoderLayer(config, world_size, parts) for _ in range(config.num_hidden_layers)]
        )
        self.norm = parts.norm(final=True)(config.hidden_size, eps=config.rms_norm_eps)
        self.sequence_parallel = parts.sequence_parallel
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)  # this rank's sequence shard under SP
        whole = (inputs_embeds.new_zeros((*input_ids.shape, inputs_embeds.shape[-1]))
                 if self.sequence_parallel else inputs_embeds)  # stands for the whole sequence

        position_ids = torch.arange(input_ids.shape[1], device=inputs_embeds.device) + PAST_SEEN_TOKENS
        position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=whole,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(whole, position_ids=position_ids)

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
            )

        hidden_states = self.norm(hidden_states)
        return hidden_states


@dataclass(frozen=True)
class LlamaParts:
    """The layer classes a Llama rank is assembled from; a planted bug swaps one of them."""

    embedding: type[VocabParallelEmbedding] = VocabParallelEmbedding
    q_proj: type[ColumnParallelLinear] = ColumnParallelLinear
    o_proj: type[RowParallelLinear] = RowParallelLinear
    down_proj: type[RowParallelLinear] = RowParallelLinear
    attention: type[nn.Module] = ParallelLlamaAttention
    mlp: type[nn.Module] = ParallelLlamaMLP
    kv_head_of_rank: Callable[[int, int, int], int] = kv_head_of_rank
    sequence_parallel: bool = False
    final_norm: type[LlamaRMSNorm] | None = None  # under SP; default: as the layers' norms
    loss: type[VocabParallelCrossEntropy] = VocabParallelCrossEntropy  # on vocab-parallel logits

    def sequence_parallel_options(self) -> dict[str, bool]:
        """Constructor options of the sharded layers (empty without sequence parallelism)."""
        return {"sequence_parallel": True} if self.sequence_parallel else {}

    def norm(self, final: bool = False) -> type[LlamaRMSNorm]:
        """The RMSNorm class: on sequence shards (gradient all-reduced) under SP."""
        if not self.sequence_parallel:
            return LlamaRMSNorm
        return self.final_norm if final and self.final_norm is not None else SequenceParallelRMSNorm


def build_llama_rank(
    config: LlamaConfig, rank: int, world_size: int, parts: LlamaParts, *, gather_logits: bool
) -> ParallelCausalLM:
    """Rank `rank` of the tensor-parallel Llama (built on the current default device)."""
    divide(config.vocab_size, world_size, "vocab_size")
    divide(config.intermediate_size, world_size, "intermediate_size")
    backbone = ParallelLlamaModel(config, rank, world_size, parts)
    return ParallelCausalLM("model", backbone, backbone.embed_tokens, config.hidden_size, config.vocab_size,
                            world_size, tie=config.tie_word_embeddings, gather_logits=gather_logits,
                            sequence_parallel=parts.sequence_parallel,
                            vocab_parallel_loss=parts.loss())
