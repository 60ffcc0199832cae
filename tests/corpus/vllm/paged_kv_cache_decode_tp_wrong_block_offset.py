"""vLLM tensor-parallel GQA attention for one decode step of a few new tokens after cached
context: fused QKVParallelLinear, reshape_and_cache into this rank's kv heads of the paged
kv_cache [2, num_blocks, block_size, num_kv_heads, head_size] via index_copy_ over the step's
slot mapping (the new slots cross a block boundary), attention over the sequence's blocks read
through its block table with a position-based causal mask, RowParallelLinear o_proj + all-reduce.
BUG: the cache write takes every new token's block from the step's first slot, so slot 8 lands
at offset 0 of block 1 (slot 4) instead of block 2."""
import torch
import torch.distributed as dist
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = ("reshape_and_cache adds slot % block_size to the first slot's block for every token, so "
       "the token in slot 8 (block 2) overwrites slot 4 of block 1 and slot 8 keeps stale data.")

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 16, 4, 2, 4
NUM_BLOCKS, BLOCK_SIZE = 4, 4
CONTEXT_LEN, NUM_NEW_TOKENS = 6, 3          # new tokens live in slots 6, 7 (block 1) and 8 (block 2)
SEQ_LEN = CONTEXT_LEN + NUM_NEW_TOKENS


def get_tensor_model_parallel_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def tensor_model_parallel_all_reduce(input_):
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_)
    return input_


def build_metadata():
    """What the model runner prepares: positions, slot mapping and the sequence's block table."""
    positions = torch.arange(CONTEXT_LEN, SEQ_LEN)
    slot_mapping = torch.arange(CONTEXT_LEN, SEQ_LEN)
    block_table = torch.arange((SEQ_LEN + BLOCK_SIZE - 1) // BLOCK_SIZE)
    return positions, slot_mapping, block_table


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """key/value [num_tokens, kv_heads, head_size] into caches [num_blocks, block_size, kv_heads,
    head_size] at the slots given by slot_mapping."""
    block_size = key_cache.shape[1]
    block_idx = slot_mapping // block_size
    block_offset = slot_mapping % block_size
    flat_slots = block_idx[0] * block_size + block_offset  # BUG
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, flat_slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, flat_slots, value)


def paged_attention(query, key_cache, value_cache, block_table, positions, scale):
    """query [num_tokens, heads, head_size] over the first SEQ_LEN slots of the sequence's blocks."""
    keys = key_cache.index_select(0, block_table).flatten(0, 1)[:SEQ_LEN]
    values = value_cache.index_select(0, block_table).flatten(0, 1)[:SEQ_LEN]
    groups = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1).transpose(0, 1)
    values = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = torch.matmul(query.transpose(0, 1), keys.transpose(1, 2)) * scale
    visible = torch.arange(SEQ_LEN)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.transpose(0, 1).reshape(query.shape[0], -1)


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = total_num_kv_heads // tp_size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = nn.Parameter(torch.empty(out, hidden_size))

    def forward(self, x):
        return torch.matmul(x, self.weight.t()), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size // get_tensor_model_parallel_world_size()))

    def forward(self, x):
        return tensor_model_parallel_all_reduce(torch.matmul(x, self.weight.t())), None


class TPDecodeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS)
        self.o_proj = RowParallelLinear(NUM_HEADS * HEAD_SIZE, HIDDEN)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * HEAD_SIZE
        self.kv_size = self.num_kv_heads * HEAD_SIZE
        self.scale = HEAD_SIZE ** -0.5

    def forward(self, hidden_states, kv_cache):
        positions, slot_mapping, block_table = build_metadata()
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, HEAD_SIZE)
        k = k.view(-1, self.num_kv_heads, HEAD_SIZE)
        v = v.view(-1, self.num_kv_heads, HEAD_SIZE)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        attn = paged_attention(q, key_cache, value_cache, block_table, positions, self.scale)
        out, _ = self.o_proj(attn)
        return out


class ReferenceAttention(nn.Module):
    """tp_size 1 with HF-style separate projections; it caches into its own copy of kv_cache."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_SIZE, bias=False)
        self.k_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_SIZE, bias=False)
        self.v_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_SIZE, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_SIZE, HIDDEN, bias=False)

    def forward(self, hidden_states, kv_cache):
        q = self.q_proj(hidden_states).view(-1, NUM_HEADS, HEAD_SIZE)
        k = self.k_proj(hidden_states).view(-1, NUM_KV_HEADS, HEAD_SIZE)
        v = self.v_proj(hidden_states).view(-1, NUM_KV_HEADS, HEAD_SIZE)
        cache = kv_cache.clone().flatten(1, 2)           # [2, slots, kv_heads, head_size]
        cache[0, CONTEXT_LEN:SEQ_LEN] = k
        cache[1, CONTEXT_LEN:SEQ_LEN] = v
        keys = cache[0, :SEQ_LEN].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        values = cache[1, :SEQ_LEN].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * HEAD_SIZE ** -0.5
        causal = torch.ones(NUM_NEW_TOKENS, SEQ_LEN, dtype=torch.bool).tril(CONTEXT_LEN)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = torch.einsum("hts,shd->thd", probs, values).reshape(NUM_NEW_TOKENS, -1)
        return self.o_proj(attn)


def reference():
    return ReferenceAttention()


def rank_module(rank, world_size):
    return TPDecodeAttention()


def shard(state, rank, world_size):
    """Checkpoint loader: this rank's query heads, then its kv heads of k and v, fused."""
    q, k, v = (state[f"{n}_proj.weight"].chunk(world_size, 0)[rank] for n in "qkv")
    return {"qkv_proj.weight": torch.cat([q, k, v], dim=0).clone(),
            "o_proj.weight": state["o_proj.weight"].chunk(world_size, 1)[rank].clone()}


def inputs():
    return {"hidden_states": torch.randn(NUM_NEW_TOKENS, HIDDEN),
            "kv_cache": torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)}


INPUT_PLACEMENTS = {"kv_cache": scalify.Shard(3)}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
