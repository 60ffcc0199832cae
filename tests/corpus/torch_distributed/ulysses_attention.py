"""Hand-written Ulysses (DeepSpeed-Ulysses style) sequence-parallel causal self-attention:
the sequence is sharded, Q/K/V are exchanged with dist.all_to_all_single (scatter heads, gather
sequence), full-sequence attention runs on the local heads, and a second all-to-all returns to
sequence shards before the (replicated) output projection."""
import math

import torch
import torch.distributed as dist
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

D_MODEL, N_HEADS, SEQ = 16, 4, 8


def seq_to_head_all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, s/P, H, d] -> [b, s, H/P, d]"""
    world = dist.get_world_size(group)
    b, s_local, h, d = x.shape
    send = x.reshape(b, s_local, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)           # recv[j]: rank j's sequence chunk
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h // world, d)


def head_to_seq_all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """[b, s, H/P, d] -> [b, s/P, H, d]"""
    world = dist.get_world_size(group)
    b, s, h_local, d = x.shape
    send = x.reshape(b, world, s // world, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)           # recv[j]: rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h_local, d)


def causal_attention(q, k, v):
    """q, k, v: [b, s, h, d]"""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = scores.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.head_dim = D_MODEL // N_HEADS
        self.q_proj = nn.Linear(D_MODEL, D_MODEL)
        self.k_proj = nn.Linear(D_MODEL, D_MODEL)
        self.v_proj = nn.Linear(D_MODEL, D_MODEL)
        self.out_proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, N_HEADS, self.head_dim)
        k = self.k_proj(hidden_states).view(b, s, N_HEADS, self.head_dim)
        v = self.v_proj(hidden_states).view(b, s, N_HEADS, self.head_dim)
        if self.sequence_parallel:
            q, k, v = (seq_to_head_all_to_all(t) for t in (q, k, v))
        context = causal_attention(q, k, v)
        if self.sequence_parallel:
            context = head_to_seq_all_to_all(context)
        return self.out_proj(context.reshape(b, s, D_MODEL))


def reference() -> nn.Module:
    return SelfAttention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return SelfAttention(sequence_parallel=True)


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(2, SEQ, D_MODEL)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
