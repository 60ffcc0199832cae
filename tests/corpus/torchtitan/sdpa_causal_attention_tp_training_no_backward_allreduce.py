"""Llama-style causal SDPA attention block under torchtitan TP, one training step; the colwise input region's backward does not all-reduce the input gradient."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torchtitan"
STEP = "training"
WORLD_SIZE = 2
BUG = "The backward of the copy-to-TP-region before wq/wk/wv returns the local input gradient without all-reducing it, so the norm weight gradient is a partial sum."

DIM = 16
N_HEADS = 4
BATCH = 2
SEQ = 8


def _wait(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


class _CopyToTPRegion(torch.autograd.Function):
    """Identity in forward; all-reduce of the input gradient in backward (f in Megatron's notation)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = grad_output  # BUG
        return grad_input, None


class _ReduceFromTPRegion(torch.autograd.Function):
    """All-reduce in forward; identity in backward (g in Megatron's notation)."""

    @staticmethod
    def forward(ctx, x, group):
        return _wait(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight


class Attention(nn.Module):
    """torchtitan's Attention: n_heads here is the (local) number of heads this module owns."""

    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1 so that the local (sharded) head count is inferred, as torchtitan does under TP
        xq = xq.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xk = xk.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xv = xv.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, dim // n_heads)

    def forward(self, x, y):
        h = x + self.attention(self.attention_norm(x))
        loss = F.mse_loss(h, y)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class TPAttention(Attention):
    """Attention after parallelize_module: colwise wq/wk/wv, rowwise wo (local shards)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, group):
        super().__init__(dim, n_heads, head_dim)
        self.group = group

    def forward(self, x):
        # ColwiseParallel input: replicated activation, gradient summed over the TP ranks
        x = _CopyToTPRegion.apply(x, self.group)
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xk = xk.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        xv = xv.view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        # RowwiseParallel output: partial sums reduced to a replicated activation
        return _ReduceFromTPRegion.apply(self.wo(output), self.group)


class TPBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, tp_size: int, group):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = TPAttention(dim, n_heads // tp_size, dim // n_heads, group)

    def forward(self, x, y):
        h = x + self.attention(self.attention_norm(x))
        loss = F.mse_loss(h, y)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    torch.manual_seed(0)
    return Block(DIM, N_HEADS)


def rank_module(rank: int, world_size: int) -> nn.Module:
    return TPBlock(DIM, N_HEADS, world_size, dist.group.WORLD)


def inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"x": torch.randn(BATCH, SEQ, DIM), "y": torch.randn(BATCH, SEQ, DIM)}


PARAM_PLACEMENTS = {
    "attention.wq.weight": scalify.Shard(0),
    "attention.wk.weight": scalify.Shard(0),
    "attention.wv.weight": scalify.Shard(0),
    "attention.wo.weight": scalify.Shard(1),
}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [
    scalify.Replicate(),  # loss
    scalify.Replicate(),  # attention_norm.weight
    scalify.Shard(0),  # attention.wq.weight
    scalify.Shard(0),  # attention.wk.weight
    scalify.Shard(0),  # attention.wv.weight
    scalify.Shard(1),  # attention.wo.weight
]
