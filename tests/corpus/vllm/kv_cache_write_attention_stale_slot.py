"""vLLM LlamaAttention for a chunked-prefill step with a paged KV cache (column-parallel qkv,
heads divided over tp ranks, k/v slice-written into the preallocated cache, causal attention over
the cache, row-parallel o_proj with all-reduce), where the step's keys are written into a slot
range shifted one slot early, so attention reads a stale key."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = ("The step's keys are written one slot early (slots 2..5 instead of 3..6): the last "
       "context token's key is overwritten and the last new token's slot keeps a stale key.")

HIDDEN, NUM_HEADS = 16, 4
HEAD_SIZE = HIDDEN // NUM_HEADS
NUM_BLOCKS, BLOCK_SIZE = 2, 4          # 8 cache slots
CONTEXT_LEN = 3                         # tokens cached by earlier steps (slots 0..2)
NUM_TOKENS = 4                          # this step's tokens (slots 3..6)


def get_tensor_model_parallel_world_size():
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(input_):
    dist.all_reduce(input_)
    return input_


@dataclass
class AttentionMetadata:
    """One sequence's chunked-prefill step: its new tokens occupy one contiguous slot range."""

    context_len: int
    num_tokens: int

    @property
    def slot_start(self) -> int:
        return self.context_len

    @property
    def slot_end(self) -> int:
        return self.context_len + self.num_tokens

    def causal_mask(self) -> torch.Tensor:
        """[num_tokens, slot_end]: token i (at position context_len + i) sees slots <= its own."""
        q_pos = torch.arange(self.num_tokens) + self.context_len
        k_pos = torch.arange(self.slot_end)
        return k_pos[None, :] <= q_pos[:, None]


def get_attn_metadata() -> AttentionMetadata:
    return AttentionMetadata(context_len=CONTEXT_LEN, num_tokens=NUM_TOKENS)


def sdpa_prefill(query, key_cache, value_cache, attn_metadata, scale):
    """TorchSDPA backend: query [num_tokens, heads, head_size] against the cache's first
    slot_end slots (flattened [slots, heads, head_size])."""
    keys = key_cache[:attn_metadata.slot_end]
    values = value_cache[:attn_metadata.slot_end]
    out = F.scaled_dot_product_attention(query.transpose(0, 1), keys.transpose(0, 1),
                                         values.transpose(0, 1),
                                         attn_mask=attn_metadata.causal_mask(), scale=scale)
    return out.transpose(0, 1)


class LlamaAttention(nn.Module):
    """Single-device reference (tp_size 1). It writes into its own copy of the cache so the
    caller's cache is left as it found it."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.scaling = HEAD_SIZE ** -0.5

    def forward(self, hidden_states, kv_cache):
        meta = get_attn_metadata()
        q, k, v = self.qkv_proj(hidden_states).split([HIDDEN, HIDDEN, HIDDEN], dim=-1)
        cache = kv_cache.clone().view(2, NUM_BLOCKS * BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
        cache[0, meta.slot_start:meta.slot_end] = k.view(-1, NUM_HEADS, HEAD_SIZE)
        cache[1, meta.slot_start:meta.slot_end] = v.view(-1, NUM_HEADS, HEAD_SIZE)
        attn = sdpa_prefill(q.view(-1, NUM_HEADS, HEAD_SIZE), cache[0], cache[1], meta,
                            self.scaling)
        return self.o_proj(attn.reshape(-1, HIDDEN))


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden_size, head_size, total_num_heads):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = total_num_heads // tp_size
        self.output_size_per_partition = 3 * self.num_heads * head_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, hidden_size))

    def forward(self, input_):
        return F.linear(input_, self.weight), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, reduce_results=True):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size // self.tp_size
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        if self.reduce_results and self.tp_size > 1:
            output_parallel = tensor_model_parallel_all_reduce(output_parallel)
        return output_parallel, None


class Attention(nn.Module):
    """vllm.attention.Attention: caches this step's k/v, then attends over the cache."""

    def __init__(self, num_heads, head_size, scale):
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale

    def write_to_kv_cache(self, key, value, key_cache, value_cache, attn_metadata):
        """reshape_and_cache for a contiguous slot range (views into the paged cache)."""
        start, end = attn_metadata.slot_start, attn_metadata.slot_end
        key_cache[start - 1:end - 1] = key  # BUG
        value_cache[start:end].copy_(value)

    def forward(self, query, key, value, kv_cache, attn_metadata):
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_heads, self.head_size)
        value = value.view(-1, self.num_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_cache = key_cache.view(-1, self.num_heads, self.head_size)
        value_cache = value_cache.view(-1, self.num_heads, self.head_size)
        self.write_to_kv_cache(key, value, key_cache, value_cache, attn_metadata)
        out = sdpa_prefill(query, key_cache, value_cache, attn_metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_size)


class TPLlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = NUM_HEADS // tp_size
        self.q_size = self.kv_size = self.num_heads * HEAD_SIZE
        self.scaling = HEAD_SIZE ** -0.5
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS)
        self.o_proj = RowParallelLinear(NUM_HEADS * HEAD_SIZE, HIDDEN)
        self.attn = Attention(self.num_heads, HEAD_SIZE, self.scaling)

    def forward(self, hidden_states, kv_cache):
        attn_metadata = get_attn_metadata()
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata)
        output, _ = self.o_proj(attn_output)
        return output


def reference():
    return LlamaAttention()


def rank_module(rank, world_size):
    return TPLlamaAttention()


def shard(state, rank, world_size):
    """Checkpoint loader: q, k and v rows each split by heads into the fused local weight."""
    q, k, v = state["qkv_proj.weight"].split([HIDDEN, HIDDEN, HIDDEN], dim=0)
    return {
        "qkv_proj.weight": torch.cat([t.chunk(world_size, 0)[rank] for t in (q, k, v)]).clone(),
        "o_proj.weight": state["o_proj.weight"].chunk(world_size, 1)[rank].clone(),
    }


def inputs():
    return {"hidden_states": torch.randn(NUM_TOKENS, HIDDEN),
            "kv_cache": torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)}


INPUT_PLACEMENTS = {"kv_cache": scalify.Shard(3)}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
