"""Context parallelism for Llama: the sequence is sharded across ranks, attention is merged over
key blocks by log-sum-exp (the online-softmax merge of ring attention).

Each rank holds a contiguous chunk of the sequence. It gathers the keys and values of all ranks,
then visits the ranks' key blocks in ring order (its own first), computing per block the
attention output and its log-sum-exp, and merges them into the running result. Rotary tables
and the causal mask are built for the whole sequence and sliced to the rank's own positions (so
positions are global, as in Megatron's `get_pos_emb_on_this_cp_rank`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import AttentionInterface, LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import repeat_kv

from scalify.errors import ShapeError

SEQUENCE_DIM = 1  # of hidden states [batch, seq, hidden]
HEAD_SEQUENCE_DIM = 2  # of attention tensors [batch, heads, seq, head_dim]
ATTENTION = "scalify_context_parallel"


@dataclass(frozen=True)
class SequenceLayout:
    """Which positions each of `world` ranks holds of a sequence of `seq` tokens: rank r holds
    the r-th of `world` contiguous chunks."""

    world: int
    seq: int

    def __post_init__(self) -> None:
        if self.seq % self.world:
            raise ShapeError(f"context parallelism over {self.world} ranks cuts the sequence into "
                             f"{self.world} equal chunks: inputs.seq ({self.seq}) must be a "
                             "multiple of that")

    @property
    def chunk(self) -> int:
        return self.seq // self.world

    def own(self, full: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """The positions `rank` holds of a whole-sequence tensor."""
        return full.narrow(dim, rank * self.chunk, self.chunk)

    def ring_order(self, rank: int) -> list[int]:
        """The ranks whose key blocks `rank` visits: its own, then as a ring passes them on."""
        return [(rank - step) % self.world for step in range(self.world)]


def gather_sequence_blocks(local: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's block of `local` [batch, heads, held, head_dim], in rank order."""
    gathered = funcol.all_gather_single(local, HEAD_SEQUENCE_DIM, dist.group.WORLD)
    held = local.shape[HEAD_SEQUENCE_DIM]
    return [gathered.narrow(HEAD_SEQUENCE_DIM, rank * held, held) for rank in range(world)]


def add_block_mask(scores: torch.Tensor, rows: torch.Tensor, layout: SequenceLayout,
                   source: int) -> torch.Tensor:
    """Scores of this rank's queries against rank `source`'s keys, masked: `rows` (the whole
    mask's rows of this rank's positions) cut to the columns of `source`'s positions."""
    return scores + layout.own(rows, 3, source)


Partial = tuple[torch.Tensor, torch.Tensor]  # attention output so far and its log-sum-exp


def online_softmax_step(result: Partial | None, scores: torch.Tensor,
                        values: torch.Tensor) -> Partial:
    """Attend to one key block and merge it into `result`: both rescaled to the joint
    log-sum-exp (the online-softmax merge)."""
    block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    block_out = torch.matmul(weights, values)
    if result is None:
        return block_out, block_lse
    out, lse = result
    merged = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - merged) * out + torch.exp(block_lse - merged) * block_out, merged


@dataclass(frozen=True)
class ContextParts:
    """The steps of a rank's blockwise attention; a planted bug swaps one of them."""

    mask: Callable[[torch.Tensor, torch.Tensor, SequenceLayout, int], torch.Tensor] = add_block_mask
    attend: Callable[[Partial | None, torch.Tensor, torch.Tensor], Partial] = online_softmax_step


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor,
                               scaling: float, dropout: float = 0.0,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention signature: this rank's queries against every rank's keys, block by block
    in ring order. `attention_mask` is the whole sequence's mask."""
    layout, parts, rank = module.sequence_layout, module.context_parts, dist.get_rank()
    groups = module.num_key_value_groups
    keys = gather_sequence_blocks(repeat_kv(key, groups), layout.world)
    values = gather_sequence_blocks(repeat_kv(value, groups), layout.world)
    rows = layout.own(attention_mask, HEAD_SEQUENCE_DIM, rank)
    result = None
    for source in layout.ring_order(rank):
        scores = parts.mask(torch.matmul(query, keys[source].transpose(2, 3)) * scaling, rows,
                            layout, source)
        result = parts.attend(result, scores, values[source])
    return result[0].transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, context_parallel_attention)


class ContextParallelLlama(nn.Module):
    """One rank of a context-parallel LlamaForCausalLM: HF's modules (so parameter names match),
    run on the rank's own positions; the logits are gathered back into sequence order."""

    def __init__(self, causal_lm: nn.Module, layout: SequenceLayout, rank: int,
                 parts: ContextParts, mask_config: LlamaConfig) -> None:
        """`mask_config` builds the whole sequence's causal mask (with eager attention's mask)."""
        super().__init__()
        self.model, self.lm_head = causal_lm.model, causal_lm.lm_head
        self.mask_config = mask_config
        self.layout, self.rank = layout, rank
        for layer in self.model.layers:
            layer.self_attn.sequence_layout = layout
            layer.self_attn.context_parts = parts

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        model, layout = self.model, self.layout
        embeds = model.embed_tokens(input_ids)  # this rank's positions
        whole = embeds.new_zeros((embeds.shape[0], layout.seq, embeds.shape[-1]))  # stands for all
        positions = torch.arange(layout.seq, device=embeds.device).unsqueeze(0)
        mask = create_causal_mask(config=self.mask_config, inputs_embeds=whole,
                                  attention_mask=attention_mask, past_key_values=None,
                                  position_ids=positions)
        cos, sin = model.rotary_emb(whole, position_ids=positions)
        own = (layout.own(cos, SEQUENCE_DIM, self.rank), layout.own(sin, SEQUENCE_DIM, self.rank))
        hidden = embeds
        for layer in model.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=own)
        logits = self.lm_head(model.norm(hidden))
        return funcol.all_gather_single(logits, SEQUENCE_DIM, dist.group.WORLD)


def context_parallel_rank(hf_config: LlamaConfig, rank: int, layout: SequenceLayout,
                          build: Callable[[LlamaConfig], nn.Module],
                          parts: ContextParts = ContextParts()) -> ContextParallelLlama:
    """Rank `rank`'s model: HF's Llama (built by `build`) with blockwise attention."""
    config = copy.deepcopy(hf_config)
    model = build(config)
    config._attn_implementation = ATTENTION
    return ContextParallelLlama(model, layout, rank, parts, hf_config)
