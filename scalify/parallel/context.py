"""Context parallelism for Llama: the sequence is sharded across ranks, attention is merged over
key blocks by log-sum-exp (the online-softmax merge of ring attention).

Each rank holds a contiguous chunk of the sequence, or with causal load balancing two chunks, one
from each end. It gathers the keys and values of all ranks, then for each of its query chunks
visits the ranks' key chunks in ring order (its own first), computing per chunk the attention
output and its log-sum-exp, and merges them into the running result. Rotary tables
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
from scalify.placements import Custom, Piece, Placement, Shard

SEQUENCE_DIM = 1  # of hidden states [batch, seq, hidden]
HEAD_SEQUENCE_DIM = 2  # of attention tensors [batch, heads, seq, head_dim]
ATTENTION = "scalify_context_parallel"


@dataclass(frozen=True)
class SequenceLayout:
    """Which positions each of `world` ranks holds of a sequence of `seq` tokens. Contiguous:
    rank r holds the r-th of `world` chunks. Balanced (causal load balancing): the sequence is
    cut into 2 * world chunks and rank r holds chunks r and 2 * world - 1 - r, so every rank
    has as many early positions (cheap under the causal mask) as late ones."""

    world: int
    seq: int
    balanced: bool = False

    def __post_init__(self) -> None:
        chunks = self.world * (2 if self.balanced else 1)
        if self.seq % chunks:
            raise ShapeError(f"context parallelism over {self.world} ranks cuts the sequence into "
                             f"{chunks} equal chunks: inputs.seq ({self.seq}) must be a "
                             "multiple of that")

    @property
    def chunk(self) -> int:
        return self.seq // (self.world * (2 if self.balanced else 1))

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks `rank` holds, in the order it holds them."""
        return [rank, 2 * self.world - 1 - rank] if self.balanced else [rank]

    def own(self, full: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """The positions `rank` holds of a whole-sequence tensor."""
        pieces = [self.piece(full, dim, chunk) for chunk in self.chunks_of(rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def piece(self, full: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
        """Chunk `chunk` of a whole-sequence tensor."""
        return full.narrow(dim, chunk * self.chunk, self.chunk)

    def in_sequence_order(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' positions gathered in rank order, put back in sequence order."""
        if not self.balanced:
            return gathered
        slots = [chunk for rank in range(self.world) for chunk in self.chunks_of(rank)]
        return torch.cat([gathered.narrow(dim, slots.index(chunk) * self.chunk, self.chunk)
                          for chunk in range(len(slots))], dim)

    def placement(self, dim: int) -> Placement:
        """How a whole-sequence input relates to the ranks' inputs (named `input_ids`)."""
        if not self.balanced:
            return Shard(dim)
        return Custom(dim, tuple(
            Piece(rank, "input_ids", slot * self.chunk, chunk * self.chunk, self.chunk)
            for rank in range(self.world) for slot, chunk in enumerate(self.chunks_of(rank))))

    def ring_order(self, rank: int) -> list[int]:
        """The ranks whose key blocks `rank` visits: its own, then as a ring passes them on."""
        return [(rank - step) % self.world for step in range(self.world)]


def gather_sequence_chunks(local: torch.Tensor, layout: SequenceLayout) -> dict[int, torch.Tensor]:
    """Every chunk of `local` [batch, heads, held, head_dim] over the ranks, by chunk number."""
    gathered = funcol.all_gather_single(local, HEAD_SEQUENCE_DIM, dist.group.WORLD)
    held = local.shape[HEAD_SEQUENCE_DIM]
    return {chunk: gathered.narrow(HEAD_SEQUENCE_DIM, rank * held + slot * layout.chunk, layout.chunk)
            for rank in range(layout.world) for slot, chunk in enumerate(layout.chunks_of(rank))}


def add_block_mask(scores: torch.Tensor, rows: torch.Tensor, layout: SequenceLayout,
                   query_chunk: int, key_chunk: int) -> torch.Tensor:
    """Scores of one query chunk against one key chunk, masked: `rows` (the whole mask's rows
    of the query chunk) cut to the key chunk's columns."""
    return scores + layout.piece(rows, 3, key_chunk)


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

    mask: Callable[[torch.Tensor, torch.Tensor, SequenceLayout, int, int], torch.Tensor] = add_block_mask
    attend: Callable[[Partial | None, torch.Tensor, torch.Tensor], Partial] = online_softmax_step


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor,
                               scaling: float, dropout: float = 0.0,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention signature: each of this rank's query chunks against every key chunk, the
    ranks' chunks visited in ring order. `attention_mask` is the whole sequence's mask."""
    layout, parts, rank = module.sequence_layout, module.context_parts, dist.get_rank()
    groups = module.num_key_value_groups
    keys = gather_sequence_chunks(repeat_kv(key, groups), layout)
    values = gather_sequence_chunks(repeat_kv(value, groups), layout)
    visits = [chunk for source in layout.ring_order(rank) for chunk in layout.chunks_of(source)]
    own = layout.chunks_of(rank)
    outputs = []
    for slot, query_chunk in enumerate(own):
        queries = query if len(own) == 1 else layout.piece(query, HEAD_SEQUENCE_DIM, slot)
        rows = layout.piece(attention_mask, HEAD_SEQUENCE_DIM, query_chunk)
        result = None
        for key_chunk in visits:
            scores = parts.mask(torch.matmul(queries, keys[key_chunk].transpose(2, 3)) * scaling,
                                rows, layout, query_chunk, key_chunk)
            result = parts.attend(result, scores, values[key_chunk])
        outputs.append(result[0])
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, HEAD_SEQUENCE_DIM)
    return output.transpose(1, 2).contiguous(), None


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
        gathered = funcol.all_gather_single(logits, SEQUENCE_DIM, dist.group.WORLD)
        return layout.in_sequence_order(gathered, SEQUENCE_DIM)


def context_parallel_rank(hf_config: LlamaConfig, rank: int, layout: SequenceLayout,
                          build: Callable[[LlamaConfig], nn.Module],
                          parts: ContextParts = ContextParts()) -> ContextParallelLlama:
    """Rank `rank`'s model: HF's Llama (built by `build`) with blockwise attention."""
    config = copy.deepcopy(hf_config)
    model = build(config)
    config._attn_implementation = ATTENTION
    return ContextParallelLlama(model, layout, rank, parts, hf_config)
