"""vLLM LlamaAttention (QKVParallelLinear with GQA, rotary, RowParallelLinear o_proj); BUG: the
softmax scaling is computed from the per-rank head count instead of the total head count."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = "The attention scaling uses hidden_size // num_heads with the local (per-rank) head count, giving the wrong head_dim ** -0.5."

HIDDEN, NUM_HEADS, NUM_KV_HEADS, ROPE_THETA, MAX_POS = 32, 4, 2, 10000.0, 16


def get_tensor_model_parallel_world_size():
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(input_):
    dist.all_reduce(input_)
    return input_


def broadcast_tensor_dict(tensor_dict, src=0):
    """The driver worker (tp rank 0) sends the step's model inputs to the other tp workers."""
    for key in sorted(tensor_dict):
        dist.broadcast(tensor_dict[key], src=src)
    return tensor_dict


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, max_position_embeddings, base, is_neox_style=True):
        super().__init__()
        self.head_size, self.is_neox_style = head_size, is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2) / head_size))
        freqs = torch.einsum("i,j->ij", torch.arange(max_position_embeddings), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        num_tokens = positions.shape[0]
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)

        def rotate(x):
            shape = x.shape
            x = x.view(num_tokens, -1, self.head_size)
            x1, x2 = torch.chunk(x, 2, dim=-1)
            c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
            return out.reshape(shape)

        return rotate(query), rotate(key)


class Attention(nn.Module):
    """Prefill-only stand-in for vllm.attention.Attention (no KV cache)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        super().__init__()
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size).transpose(0, 1)
        k, v = (x.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
                .repeat_interleave(self.num_heads // self.num_kv_heads, dim=0) for x in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return torch.matmul(probs, v).transpose(0, 1).reshape(t, self.num_heads * self.head_size)


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=False):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = nn.Parameter(torch.empty(out, hidden_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=False, reduce_results=True):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, input_size // self.tp_size))

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        if self.reduce_results and self.tp_size > 1:
            return tensor_model_parallel_all_reduce(output_parallel), None
        return output_parallel, None


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = num_heads
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = num_kv_heads
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = (hidden_size // self.num_heads) ** -0.5  # BUG
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim, MAX_POS, ROPE_THETA)
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads)

    def forward(self, positions, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class ReferenceAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // NUM_HEADS
        kv_dim = NUM_KV_HEADS * self.head_dim
        self.q_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj, self.v_proj = nn.Linear(HIDDEN, kv_dim, bias=False), nn.Linear(HIDDEN, kv_dim, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, MAX_POS, ROPE_THETA)
        self.attn = Attention(NUM_HEADS, self.head_dim, self.head_dim ** -0.5, NUM_KV_HEADS)

    def forward(self, positions, hidden_states):
        q, k = self.rotary_emb(positions, self.q_proj(hidden_states), self.k_proj(hidden_states))
        return self.o_proj(self.attn(q, k, self.v_proj(hidden_states)))


class RankModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = LlamaAttention(HIDDEN, NUM_HEADS, NUM_KV_HEADS)

    def forward(self, positions, hidden_states):
        inputs = broadcast_tensor_dict({"positions": positions.contiguous(),
                                        "hidden_states": hidden_states.contiguous()})
        return self.self_attn(inputs["positions"], inputs["hidden_states"])


def reference():
    return ReferenceAttention()


def rank_module(rank, world_size):
    return RankModel()


def shard(state, rank, world_size):
    """QKVParallelLinear.weight_loader: q heads and kv heads of this rank, stacked q|k|v."""
    head_dim = HIDDEN // NUM_HEADS
    kv_replicas = max(1, world_size // NUM_KV_HEADS)
    kv_shard = rank // kv_replicas
    kv_per_rank = max(1, NUM_KV_HEADS // world_size)
    q = state["q_proj.weight"].chunk(world_size, 0)[rank]
    kv_rows = slice(kv_shard * kv_per_rank * head_dim, (kv_shard + 1) * kv_per_rank * head_dim)
    k, v = state["k_proj.weight"][kv_rows], state["v_proj.weight"][kv_rows]
    return {"self_attn.qkv_proj.weight": torch.cat([q, k, v], 0).clone(),
            "self_attn.o_proj.weight": state["o_proj.weight"].chunk(world_size, 1)[rank].clone()}


def inputs():
    return {"positions": torch.arange(7), "hidden_states": torch.randn(7, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
