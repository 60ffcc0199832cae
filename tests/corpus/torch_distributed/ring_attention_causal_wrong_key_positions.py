"""Hand-written causal ring attention (context parallel) on 4 ranks: each rank holds a sequence
chunk, K/V blocks travel around the ring with dist.batch_isend_irecv, every block's softmax is
merged with a running log-sum-exp, blocks from later ranks are skipped, masks use global
positions. Projections are replicated.
BUG: the key positions use the local rank, not the source rank of the K/V block."""
import math

import torch
import torch.distributed as dist
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 4
BUG = "Key positions of a received block are computed from this rank instead of the block's source rank, so earlier blocks get a causal triangle mask."

D_MODEL, N_HEADS, SEQ = 16, 2, 8


def ring_send_recv(tensors, rank, world):
    """Send to rank+1, receive from rank-1; returns the received tensors."""
    tensors = [t.contiguous() for t in tensors]
    recv = [torch.empty_like(t) for t in tensors]
    ops = []
    for t, r in zip(tensors, recv):
        ops.append(dist.P2POp(dist.isend, t, (rank + 1) % world))
        ops.append(dist.P2POp(dist.irecv, r, (rank - 1) % world))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


def ring_attention(q, k, v):
    """q, k, v: [b, h, s_local, d] (this rank's chunk). Returns [b, h, s_local, d]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s_local = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = rank * s_local + torch.arange(s_local, device=q.device)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(world):
        src = (rank - step) % world
        if step + 1 < world:
            next_k, next_v = ring_send_recv([k, v], rank, world)
        if src <= rank:                      # later chunks are entirely in the future
            k_pos = rank * s_local + torch.arange(s_local, device=q.device)  # BUG
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(torch.softmax(scores, dim=-1), v)
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - new_lse).unsqueeze(-1) \
                + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
            lse = new_lse
        if step + 1 < world:
            k, v = next_k, next_v
    return out


def local_attention(q, k, v):
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.matmul(scores.masked_fill(mask, float("-inf")).softmax(-1), v)


class CausalSelfAttention(nn.Module):
    def __init__(self, context_parallel: bool = False):
        super().__init__()
        self.context_parallel = context_parallel
        self.c_attn = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.c_proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.c_attn(x).split(D_MODEL, dim=2)
        q, k, v = (t.view(b, s, N_HEADS, c // N_HEADS).transpose(1, 2) for t in (q, k, v))
        y = ring_attention(q, k, v) if self.context_parallel else local_attention(q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, c))


def reference() -> nn.Module:
    return CausalSelfAttention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return CausalSelfAttention(context_parallel=True)


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, SEQ, D_MODEL)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
