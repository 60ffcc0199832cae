"""Hand-written tensor + sequence parallel attention in Megatron's [seq, batch, hidden] layout:
the LayerNorm runs on the local sequence shard, dist.all_gather (list + torch.cat) restores the
sequence, a fused QKV projection holds this rank's heads ([q; k; v] blocks, built by a checkpoint
converter from separate q/k/v weights), the row-parallel output projection is reduce-scattered
over the sequence (reduce_scatter_tensor) and its bias is added afterwards (skip_bias_add)."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, HEADS, SEQ, BATCH = 16, 4, 8, 2


def core_attention(q, k, v):
    """q, k, v: [s, b, heads, d] -> [s, b, heads * d], causal."""
    s, b, n, d = q.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))          # [b, n, s, d]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, n * d)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states):                                # [s, b, h]
        x = self.ln(hidden_states)
        q, k, v = (p(x).view(SEQ, BATCH, HEADS, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(core_attention(q, k, v))


class ParallelAttention(nn.Module):
    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.heads_local = HEADS // world_size
        self.head_dim = HIDDEN // HEADS
        self.hidden_local = self.heads_local * self.head_dim
        self.ln = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * self.hidden_local)
        self.o_proj = nn.Linear(self.hidden_local, HIDDEN, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, hidden_states):                                # [s/P, b, h]
        x = self.ln(hidden_states)
        gathered = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(gathered, x.contiguous())
        x = torch.cat(gathered, dim=0)                               # [s, b, h]
        s, b, _ = x.shape
        mixed = self.qkv(x)
        q, k, v = mixed.split(self.hidden_local, dim=-1)
        q, k, v = (t.reshape(s, b, self.heads_local, self.head_dim) for t in (q, k, v))
        partial = self.o_proj(core_attention(q, k, v))
        out = partial.new_empty(s // self.world_size, b, HIDDEN)
        dist.reduce_scatter_tensor(out, partial.contiguous())
        return out + self.o_bias


def reference() -> nn.Module:
    return Attention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return ParallelAttention(world_size)


def shard(state, rank, world_size):
    def rows(name):
        return state[name].chunk(world_size, dim=0)[rank]
    return {
        "ln.weight": state["ln.weight"].clone(), "ln.bias": state["ln.bias"].clone(),
        "qkv.weight": torch.cat([rows("q_proj.weight"), rows("k_proj.weight"), rows("v_proj.weight")]),
        "qkv.bias": torch.cat([rows("q_proj.bias"), rows("k_proj.bias"), rows("v_proj.bias")]),
        "o_proj.weight": state["o_proj.weight"].chunk(world_size, dim=1)[rank].clone(),
        "o_bias": state["o_proj.bias"].clone(),
    }


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, BATCH, HIDDEN)}


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
