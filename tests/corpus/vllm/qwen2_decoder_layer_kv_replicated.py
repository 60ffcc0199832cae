"""vLLM Qwen2DecoderLayer at tp=2 with a single kv head (QKVParallelLinear replicates the kv head
on both ranks, q/k/v with bias), fused residual-add RMSNorm, merged gate_up MLP; the tp all-reduce
is an out-of-place functional collective (like vLLM's torch.ops.vllm.all_reduce custom op)."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, HEADS, KV_HEADS, INTER, THETA, EPS = 32, 4, 1, 48, 1000000.0, 1e-6


def get_tp_group():
    return dist.group.WORLD


def tensor_model_parallel_all_reduce(x):
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", get_tp_group()))


class RMSNorm(nn.Module):
    def __init__(self, n, eps=EPS):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return out if residual is None else (out, residual)


def rope(positions, x, head_dim):
    inv_freq = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, device=x.device) / head_dim))
    freqs = positions[:, None].to(inv_freq.dtype) * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x = x.unflatten(-1, (-1, head_dim))
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


def attention(q, k, v, head_dim, scale):
    q, k, v = (t.unflatten(-1, (-1, head_dim)).transpose(0, 1) for t in (q, k, v))
    k = k.expand(q.shape[0], -1, -1) if k.shape[0] == 1 else k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    v = v.expand(q.shape[0], -1, -1) if v.shape[0] == 1 else v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1).flatten(-2)


class Qwen2Layer(nn.Module):
    """Shared by the reference (tp_size=1) and the ranks; tp_size>1 selects the parallel layout."""

    def __init__(self, tp_size):
        super().__init__()
        self.tp_size = tp_size
        self.head_dim = HIDDEN // HEADS
        self.num_heads = HEADS // tp_size
        self.num_kv_heads = max(1, KV_HEADS // tp_size)      # kv heads replicated when KV_HEADS < tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.input_layernorm = RMSNorm(HIDDEN)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.qkv_proj = nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, HIDDEN, bias=False)
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER // tp_size, bias=False)
        self.down_proj = nn.Linear(INTER // tp_size, HIDDEN, bias=False)

    def row_parallel(self, layer, x, reduce_results=True):
        out = layer(x)
        if reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def forward(self, positions, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = rope(positions, q, self.head_dim), rope(positions, k, self.head_dim)
        attn = attention(q, k, v, self.head_dim, self.scaling)
        hidden_states = self.row_parallel(self.o_proj, attn)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        hidden_states = self.row_parallel(self.down_proj, F.silu(gate) * up)
        return hidden_states + residual


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Qwen2Layer(tp_size=1)

    def forward(self, positions, hidden_states):
        return self.layer(positions, hidden_states)


def reference():
    return Reference()


class RankModel(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.layer = Qwen2Layer(tp_size=world_size)

    def forward(self, positions, hidden_states):
        return self.layer(positions, hidden_states)


def rank_module(rank, world_size):
    return RankModel(world_size)


def shard(state, rank, world_size):
    """Qwen2 weight loading: q heads split, the single kv head replicated (shard id
    rank // num_kv_head_replicas), gate/up halves split and re-fused, o/down split on input."""
    hd = HIDDEN // HEADS
    q_size, kv_size = HEADS * hd, KV_HEADS * hd
    replicas = max(1, world_size // KV_HEADS)
    kv_id, kv_local = rank // replicas, max(1, KV_HEADS // world_size) * hd
    out = {k: v.clone() for k, v in state.items() if "layernorm" in k}
    for name in ("weight", "bias"):
        qkv = state[f"layer.qkv_proj.{name}"]
        q, k, v = qkv.split([q_size, kv_size, kv_size], 0)
        out[f"layer.qkv_proj.{name}"] = torch.cat([
            q.chunk(world_size, 0)[rank], k[kv_id * kv_local:(kv_id + 1) * kv_local],
            v[kv_id * kv_local:(kv_id + 1) * kv_local]], 0).clone()
    gate, up = state["layer.gate_up_proj.weight"].chunk(2, 0)
    out["layer.gate_up_proj.weight"] = torch.cat([gate.chunk(world_size, 0)[rank],
                                                  up.chunk(world_size, 0)[rank]], 0).clone()
    out["layer.o_proj.weight"] = state["layer.o_proj.weight"].chunk(world_size, 1)[rank].clone()
    out["layer.down_proj.weight"] = state["layer.down_proj.weight"].chunk(world_size, 1)[rank].clone()
    return out


def inputs():
    return {"positions": torch.arange(6), "hidden_states": torch.randn(6, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
