"""vLLM Qwen2Attention with tensor parallelism where the kv heads (1) are fewer than the TP ranks:
QKVParallelLinear holds each rank's query heads and a full copy of the single kv head
(num_kv_head_replicas = tp_size // total_num_kv_heads), causal SDPA on the local heads, and a
RowParallelLinear o_proj whose partial outputs are all-reduced."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN = 32
NUM_HEADS = 4
NUM_KV_HEADS = 1
HEAD_DIM = HIDDEN // NUM_HEADS
BATCH = 2
SEQ = 8


def _sdpa_gqa(q, k, v):
    """q: [b, hq, s, d]; k, v: [b, hkv, s, d]; kv heads repeated to the query heads."""
    num_queries_per_kv = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(num_queries_per_kv, dim=1)
    v = v.repeat_interleave(num_queries_per_kv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ReferenceQwen2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_DIM, bias=True)
        self.k_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=True)
        self.v_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=True)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        attn = _sdpa_gqa(q, k, v).transpose(1, 2).reshape(b, s, NUM_HEADS * HEAD_DIM)
        return self.o_proj(attn)


def divide(numerator, denominator):
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def tensor_model_parallel_all_reduce(input_):
    if dist.get_world_size() == 1:
        return input_
    dist.all_reduce(input_)
    return input_


class QKVParallelLinear(nn.Module):
    """Fused q/k/v column-parallel linear; the output is [q | k | v] of this rank's heads."""

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=True):
        super().__init__()
        tp_size = dist.get_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size_per_partition = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = nn.Parameter(torch.empty(output_size_per_partition, hidden_size))
        self.bias = nn.Parameter(torch.empty(output_size_per_partition)) if bias else None

    def forward(self, input_):
        return F.linear(input_, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=False, reduce_results=True):
        super().__init__()
        tp_size = dist.get_world_size()
        self.input_size_per_partition = divide(input_size, tp_size)
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        assert not bias

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        if self.reduce_results:
            return tensor_model_parallel_all_reduce(output_parallel)
        return output_parallel


class Qwen2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        tp_size = dist.get_world_size()
        self.total_num_heads = NUM_HEADS
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = NUM_KV_HEADS
        # the kv heads are fewer than the TP ranks: each rank replicates one kv head
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = HEAD_DIM
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(HIDDEN, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=True)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, HIDDEN, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        attn_output = _sdpa_gqa(q, k, v)
        attn_output = attn_output.transpose(1, 2).reshape(b, s, self.q_size)
        return self.o_proj(attn_output)


def reference() -> nn.Module:
    return ReferenceQwen2Attention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return Qwen2Attention()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(BATCH, SEQ, HIDDEN)}


def shard(state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """HF checkpoint -> this rank's vLLM weights (the weight_loader of QKVParallelLinear with
    shard ids "q", "k", "v", and of RowParallelLinear)."""
    num_heads = NUM_HEADS // world_size
    q_rows = slice(rank * num_heads * HEAD_DIM, (rank + 1) * num_heads * HEAD_DIM)
    if world_size >= NUM_KV_HEADS:
        num_kv_heads = 1
        kv_head = rank // (world_size // NUM_KV_HEADS)  # the kv head this rank replicates
    else:
        num_kv_heads = NUM_KV_HEADS // world_size
        kv_head = rank * num_kv_heads
    kv_rows = slice(kv_head * HEAD_DIM, (kv_head + num_kv_heads) * HEAD_DIM)
    local = {}
    for name in ("weight", "bias"):
        local[f"qkv_proj.{name}"] = torch.cat([state[f"q_proj.{name}"][q_rows],
                                               state[f"k_proj.{name}"][kv_rows],
                                               state[f"v_proj.{name}"][kv_rows]], dim=0).clone()
    local["o_proj.weight"] = state["o_proj.weight"][:, q_rows].clone()
    return local


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
