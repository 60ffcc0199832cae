"""DeepSpeed-Ulysses sequence-parallel causal self-attention with grouped-query attention, where
the k/v all-to-all scatters heads with the query heads-per-rank count instead of the kv one, so
the exchange mixes batch/sequence positions and heads and each rank gets the wrong kv heads."""
import math

import torch
import torch.distributed as dist
from torch import nn

import scalify

STYLE = "deepspeed"
STEP = "forward"
WORLD_SIZE = 2
BUG = ("k and v are exchanged with the head-scatter split of the query heads per rank "
       "(num_heads // sp) instead of the kv heads per rank, so each rank receives the wrong kv "
       "heads.")

HIDDEN = 32
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS
BATCH = 2
SEQ = 8


def _causal_attention(q, k, v):
    """q: [b, hq, s, d]; k, v: [b, hkv, s, d] with hq a multiple of hkv."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    seq = q.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


class ReferenceAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        out = _causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, NUM_HEADS * HEAD_DIM)
        return self.o_proj(out)


def single_all_to_all(input, scatter_idx, gather_idx, heads_per_rank, group):
    """All-to-all over the sequence-parallel group on a [batch, seq, heads, head_dim] tensor.

    scatter_idx=2, gather_idx=1: [b, s/P, H, d] -> [b, s, heads_per_rank, d]
    scatter_idx=1, gather_idx=2: [b, s, heads_per_rank, d] -> [b, s/P, P * heads_per_rank, d]
    """
    seq_world_size = dist.get_world_size(group)
    if scatter_idx == 2:
        b, s_local, _, d = input.shape
        # sequence first, so that the chunks received from the ranks land in sequence order
        input_t = input.transpose(0, 1)
        # group the heads by destination rank and move the rank groups to dim 0
        input_t = input_t.reshape(-1, seq_world_size, heads_per_rank, d).transpose(0, 1).contiguous()
        output = torch.empty_like(input_t)
        dist.all_to_all_single(output, input_t, group=group)
        # output[j]: rank j's sequence chunk of this rank's heads
        output = output.reshape(seq_world_size * s_local, b, -1, d)
        return output.transpose(0, 1).contiguous()
    assert scatter_idx == 1 and gather_idx == 2
    b, s, _, d = input.shape
    s_local = s // seq_world_size
    # [b, s, h, d] -> [P, s/P, b, h, d]: the sequence chunk for rank j is block j
    input_t = input.transpose(0, 1).reshape(seq_world_size, s_local, b, heads_per_rank, d).contiguous()
    output = torch.empty_like(input_t)
    dist.all_to_all_single(output, input_t, group=group)
    # output[j]: this rank's sequence chunk of rank j's heads -> heads in rank order
    output = output.permute(1, 2, 0, 3, 4).reshape(s_local, b, seq_world_size * heads_per_rank, d)
    return output.transpose(0, 1).contiguous()


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, scatter_idx, gather_idx, heads_per_rank):
        ctx.group = group
        ctx.scatter_idx = scatter_idx
        ctx.gather_idx = gather_idx
        ctx.heads_per_rank = heads_per_rank
        return single_all_to_all(input, scatter_idx, gather_idx, heads_per_rank, group)

    @staticmethod
    def backward(ctx, *grad_output):
        return (None,
                _SeqAllToAll.apply(ctx.group, *grad_output, ctx.gather_idx, ctx.scatter_idx,
                                   ctx.heads_per_rank),
                None, None, None)


class DistributedAttention(nn.Module):
    """Ulysses attention: q/k/v projections replicated, input and output sharded on sequence."""

    def __init__(self, sequence_process_group=None):
        super().__init__()
        self.spg = sequence_process_group if sequence_process_group is not None else dist.group.WORLD
        sp_size = dist.get_world_size(self.spg)
        assert NUM_HEADS % sp_size == 0 and NUM_KV_HEADS % sp_size == 0
        self.num_heads_per_rank = NUM_HEADS // sp_size
        self.num_kv_heads_per_rank = NUM_KV_HEADS // sp_size
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden_states):
        # hidden_states: [b, s/P, hidden]
        b, s_local, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s_local, NUM_HEADS, HEAD_DIM)
        k = self.k_proj(hidden_states).view(b, s_local, NUM_KV_HEADS, HEAD_DIM)
        v = self.v_proj(hidden_states).view(b, s_local, NUM_KV_HEADS, HEAD_DIM)

        # scatter heads, gather sequence: [b, s/P, H, d] -> [b, s, H/P, d]
        q = _SeqAllToAll.apply(self.spg, q, 2, 1, self.num_heads_per_rank)
        k, v = (_SeqAllToAll.apply(self.spg, t, 2, 1, self.num_heads_per_rank) for t in (k, v))  # BUG

        context = _causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        context = context.transpose(1, 2)  # [b, s, H/P, d]

        # scatter sequence, gather heads: [b, s, H/P, d] -> [b, s/P, H, d]
        context = _SeqAllToAll.apply(self.spg, context, 1, 2, self.num_heads_per_rank)
        context = context.reshape(b, s_local, NUM_HEADS * HEAD_DIM)
        return self.o_proj(context)


def reference() -> nn.Module:
    return ReferenceAttention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DistributedAttention()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(BATCH, SEQ, HIDDEN)}


PARAM_PLACEMENTS = {}  # the projections are replicated on the sequence-parallel ranks
INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
