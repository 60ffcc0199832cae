"""LLaMA (Meta, fairscale model parallel) attention sub-block training step: h = x + wo(attn(n)) with
n = attention_norm(x), Meta's complex rotary embeddings (precompute_freqs_cis with torch.polar,
view_as_complex on the q/k pairs, view_as_real(...).flatten(3)) and a causal mask; wq/wk/wv are
ColumnParallelLinear(gather_output=False) so each rank owns n_heads/mp heads, wo is
RowParallelLinear(input_is_parallel=True). Loss = MSE(h, target); the copy/reduce region autograd
functions carry the all-reduces, so the replicated attention_norm weight gets its full gradient
on every rank through the copy's backward."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "training"
WORLD_SIZE = 2
BUG = None

DIM, N_HEADS, MAX_SEQ_LEN, NORM_EPS = 32, 4, 8, 1e-5

# ---- fairscale.nn.model_parallel.initialize (imitation) ----
_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(model_parallel_size):
    global _MODEL_PARALLEL_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    for i in range(world // model_parallel_size):
        ranks = list(range(i * model_parallel_size, (i + 1) * model_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP = group


def get_model_parallel_group():
    return _MODEL_PARALLEL_GROUP


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


# ---- fairscale.nn.model_parallel.mappings (imitation) ----
def _reduce(input_):
    """All-reduce the input tensor across model parallel group."""
    group = get_model_parallel_group()
    if dist.get_world_size(group=group) == 1:
        return input_
    torch.distributed.all_reduce(input_, group=group)
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Pass the input to the model parallel region."""

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region."""

    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


# ---- fairscale.nn.model_parallel.layers (imitation) ----
class ColumnParallelLinear(nn.Module):
    """Y = XA with A split along its second dimension (rows of the torch weight)."""

    def __init__(self, in_features, out_features, bias=True, gather_output=True, init_method=lambda x: x):
        super().__init__()
        assert not bias and not gather_output
        self.in_features = in_features
        self.out_features = out_features
        self.output_size_per_partition = out_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, self.in_features))
        self.bias = None

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        return output_parallel


class RowParallelLinear(nn.Module):
    """Y = XA with A split along its first dimension (columns of the torch weight)."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=False, init_method=lambda x: x):
        super().__init__()
        assert not bias and input_is_parallel
        self.in_features = in_features
        self.out_features = out_features
        self.input_size_per_partition = in_features // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.out_features, self.input_size_per_partition))
        self.bias = None

    def forward(self, input_):
        input_parallel = input_
        output_parallel = F.linear(input_parallel, self.weight)
        output_ = reduce_from_model_parallel_region(output_parallel)
        return output_


# ---- llama/model.py (imitation) ----
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _plain_linear(in_features, out_features, bias=False, **kwargs):
    return nn.Linear(in_features, out_features, bias=bias)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, model_parallel_size, column, row):
        super().__init__()
        self.n_local_heads = n_heads // model_parallel_size
        self.head_dim = dim // n_heads
        self.wq = column(dim, n_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x)
        self.wk = column(dim, n_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x)
        self.wv = column(dim, n_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x)
        self.wo = row(n_heads * self.head_dim, dim, bias=False, input_is_parallel=True, init_method=lambda x: x)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        keys, values = xk, xv  # training: no KV cache
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, slen, cache_len + slen)
        scores = F.softmax(scores, dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, n_local_heads, slen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class AttentionBlock(nn.Module):
    """The attention half of llama's TransformerBlock, with the Transformer's freqs_cis and mask."""

    def __init__(self, model_parallel_size, column, row):
        super().__init__()
        self.attention = Attention(DIM, N_HEADS, model_parallel_size, column, row)
        self.attention_norm = RMSNorm(DIM, eps=NORM_EPS)
        self.freqs_cis = precompute_freqs_cis(DIM // N_HEADS, MAX_SEQ_LEN * 2)

    def forward(self, x, target):
        start_pos = 0
        _bsz, seqlen, _ = x.shape
        self.freqs_cis = self.freqs_cis.to(x.device)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((1, 1, seqlen, seqlen), float("-inf"), device=x.device)
            mask = torch.triu(mask, diagonal=start_pos + 1).type_as(x)
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        loss = F.mse_loss(h, target)
        params = [self.attention_norm.weight, self.attention.wq.weight, self.attention.wk.weight,
                  self.attention.wv.weight, self.attention.wo.weight]
        return (loss, *torch.autograd.grad(loss, params))


def reference():
    return AttentionBlock(1, _plain_linear, _plain_linear)


def rank_module(rank, world_size):
    initialize_model_parallel(world_size)
    return AttentionBlock(get_model_parallel_world_size(), ColumnParallelLinear, RowParallelLinear)


def inputs():
    return {"x": torch.randn(2, 6, DIM), "target": torch.randn(2, 6, DIM)}


PARAM_PLACEMENTS = {"attention.wq.weight": scalify.Shard(0), "attention.wk.weight": scalify.Shard(0),
                    "attention.wv.weight": scalify.Shard(0), "attention.wo.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(),   # loss
                     scalify.Replicate(),   # attention_norm.weight grad
                     scalify.Shard(0),      # wq grad
                     scalify.Shard(0),      # wk grad
                     scalify.Shard(0),      # wv grad
                     scalify.Shard(1)]      # wo grad
