"""LLaMA-2 (Meta, fairscale model parallel) Attention forward at prefill (start_pos=0): wq/wk/wv are
ColumnParallelLinear(gather_output=False) so each rank owns n_heads/mp query heads and
n_kv_heads/mp kv heads (repeat_kv inside the rank), complex-valued rotary (freqs_cis,
view_as_complex), per-rank KV cache written in place, wo is RowParallelLinear(input_is_parallel=True)."""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

DIM, N_HEADS, N_KV_HEADS, MAX_BATCH, MAX_SEQ = 32, 4, 2, 2, 16


def get_model_parallel_group():
    return dist.group.WORLD


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        dist.all_reduce(grad_output, group=get_model_parallel_group())
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=get_model_parallel_group())
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, gather_output=False, init_method=lambda x: x):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features // get_model_parallel_world_size(), in_features))

    def forward(self, input_):
        return F.linear(_CopyToModelParallelRegion.apply(input_), self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, input_is_parallel=True, init_method=lambda x: x):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // get_model_parallel_world_size()))

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        return _ReduceFromModelParallelRegion.apply(output_parallel)


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), \
        torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, model_parallel_size, linear_cls):
        super().__init__()
        self.n_kv_heads = N_KV_HEADS
        self.n_local_heads = N_HEADS // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = DIM // N_HEADS
        column, row = linear_cls
        self.wq = column(DIM, N_HEADS * self.head_dim)
        self.wk = column(DIM, self.n_kv_heads * self.head_dim)
        self.wv = column(DIM, self.n_kv_heads * self.head_dim)
        self.wo = row(N_HEADS * self.head_dim, DIM)
        self.cache_k = torch.zeros((MAX_BATCH, MAX_SEQ, self.n_local_kv_heads, self.head_dim))
        self.cache_v = torch.zeros((MAX_BATCH, MAX_SEQ, self.n_local_kv_heads, self.head_dim))

    def forward(self, x, start_pos=0):
        bsz, seqlen, _ = x.shape
        freqs_cis = precompute_freqs_cis(self.head_dim, MAX_SEQ * 2)[start_pos:start_pos + seqlen]
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=x.device), diagonal=1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos), device=x.device), mask])
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos: start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos: start_pos + seqlen] = xv
        keys = repeat_kv(self.cache_k[:bsz, : start_pos + seqlen], self.n_rep)
        values = repeat_kv(self.cache_v[:bsz, : start_pos + seqlen], self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = F.softmax(scores + mask, dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


def _linear(i, o):
    return nn.Linear(i, o, bias=False)


def reference():
    return Attention(1, (_linear, _linear))


def rank_module(rank, world_size):
    return Attention(world_size, (ColumnParallelLinear, RowParallelLinear))


def inputs():
    return {"x": torch.randn(2, 6, DIM)}


PARAM_PLACEMENTS = {"wq.weight": scalify.Shard(0), "wk.weight": scalify.Shard(0),
                    "wv.weight": scalify.Shard(0), "wo.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
