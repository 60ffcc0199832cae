"""Megatron-LM (mpu) ParallelAttention on [sq, b, h]: fused query_key_value ColumnParallelLinear
with the per-head [np, 3, hn] layout, baddbmm/bmm core attention with a causal mask, and a
RowParallelLinear dense projection; the checkpoint converter interleaves separate q/k/v weights."""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, HEADS, SEQ = 16, 4, 6
HEAD_DIM = HIDDEN // HEADS

_TP_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_):
    global _TP_GROUP
    for i in range(dist.get_world_size() // tensor_model_parallel_size_):
        ranks = list(range(i * tensor_model_parallel_size_, (i + 1) * tensor_model_parallel_size_))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            _TP_GROUP = group


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        dist.all_reduce(grad_output, group=_TP_GROUP)
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=_TP_GROUP)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def divide(numerator, denominator):
    assert numerator % denominator == 0
    return numerator // denominator


def split_tensor_along_last_dim(tensor, num_partitions, contiguous_split_chunks=False):
    last_dim_size = divide(tensor.size()[-1], num_partitions)
    tensor_list = torch.split(tensor, last_dim_size, dim=tensor.dim() - 1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in tensor_list)
    return tensor_list


class ParallelAttention(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(dist.get_world_size())
        world_size = dist.get_world_size(group=_TP_GROUP)
        self.hidden_size_per_partition = divide(HIDDEN, world_size)
        self.hidden_size_per_attention_head = divide(HIDDEN, HEADS)
        self.num_attention_heads_per_partition = divide(HEADS, world_size)
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        # ColumnParallelLinear(h, 3h, gather_output=False) and RowParallelLinear(h, h, input_is_parallel=True)
        self.query_key_value = nn.Linear(HIDDEN, 3 * self.hidden_size_per_partition)
        self.dense = nn.Linear(self.hidden_size_per_partition, HIDDEN)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [sq, b, h]
        mixed_x_layer = F.linear(_CopyToModelParallelRegion.apply(hidden_states),
                                 self.query_key_value.weight, self.query_key_value.bias)
        # [sq, b, (np * 3 * hn)] --> [sq, b, np, 3 * hn]
        new_tensor_shape = mixed_x_layer.size()[:-1] + \
            (self.num_attention_heads_per_partition, 3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        (query_layer, key_layer, value_layer) = split_tensor_along_last_dim(mixed_x_layer, 3)

        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_input_buffer = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                          dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(matmul_input_buffer, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2),
                                      beta=0.0, alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)
        attention_scores.masked_fill_(attention_mask, -10000.0)
        attention_probs = torch.nn.Softmax(dim=-1)(attention_scores)

        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size[:3], -1)
        # [b, np, sq, hn] --> [sq, b, np, hn] --> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.hidden_size_per_partition)

        output_parallel = F.linear(context_layer, self.dense.weight)
        output = _ReduceFromModelParallelRegion.apply(output_parallel)
        return output + self.dense.bias


class ReferenceAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, attention_mask):
        s, b, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(s, b, HEADS, HEAD_DIM).permute(1, 2, 0, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(attention_mask, -10000.0).softmax(-1)
        ctx = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, HIDDEN)
        return self.o_proj(ctx)


def reference() -> nn.Module:
    return ReferenceAttention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return ParallelAttention()


def shard(state, rank, world_size):
    """HF-style q/k/v -> Megatron's per-head interleaved query_key_value, heads split over ranks."""
    heads = HEADS // world_size
    per_head = lambda t: t.view(HEADS, HEAD_DIM, *t.shape[1:])[rank * heads:(rank + 1) * heads]
    out = {}
    for suffix in ("weight", "bias"):
        q, k, v = (per_head(state[f"{n}_proj.{suffix}"]) for n in "qkv")
        out[f"query_key_value.{suffix}"] = torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:]).clone()
    out["dense.weight"] = torch.chunk(state["o_proj.weight"], world_size, 1)[rank].clone()
    out["dense.bias"] = state["o_proj.bias"].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return {"hidden_states": torch.randn(SEQ, 2, HIDDEN), "attention_mask": mask}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
