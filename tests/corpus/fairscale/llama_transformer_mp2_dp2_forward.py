"""Original LLaMA (Meta) Transformer forward with fairscale model parallel on 4 ranks:
initialize_model_parallel(2) builds model-parallel groups [0,1],[2,3] (data-parallel [0,2],[1,3]);
ParallelEmbedding, one TransformerBlock (ColumnParallelLinear(gather_output=False) /
RowParallelLinear(input_is_parallel=True) attention and FFN, complex rotary), final RMSNorm and a
ColumnParallelLinear(gather_output=True) output head; every rank returns the full logits."""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "forward"
WORLD_SIZE = 4
BUG = None

VOCAB, DIM, N_HEADS, HIDDEN, MP = 32, 16, 4, 48, 2
_MP_GROUP = None


def initialize_model_parallel(model_parallel_size):
    global _MP_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = torch.LongTensor(range(world)).reshape(world // model_parallel_size, model_parallel_size)
    found = torch.where(groups == rank)
    for i in range(groups.shape[0]):
        group = dist.new_group(groups[i, :].tolist())
        if i == found[0].item():
            _MP_GROUP = group
    for j in range(model_parallel_size):          # data parallel groups (unused in inference)
        dist.new_group(groups[:, j].tolist())


def mp_size():
    return dist.get_world_size(group=_MP_GROUP)


def mp_rank():
    return dist.get_rank(group=_MP_GROUP)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _reduce(g)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(mp_size())]
        dist.all_gather(parts, x.contiguous(), group=_MP_GROUP)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(mp_size(), dim=-1)[mp_rank()].contiguous()


def _reduce(x):
    dist.all_reduce(x, group=_MP_GROUP)
    return x


class ParallelEmbedding(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d // mp_size()))

    def forward(self, tokens):
        return _Gather.apply(F.embedding(tokens, self.weight))


class ColumnParallelLinear(nn.Module):
    def __init__(self, i, o, bias=False, gather_output=True, init_method=None):
        super().__init__()
        self.gather_output, self.weight = gather_output, nn.Parameter(torch.empty(o // mp_size(), i))

    def forward(self, x):
        out = F.linear(_Copy.apply(x), self.weight)
        return _Gather.apply(out) if self.gather_output else out


class RowParallelLinear(nn.Module):
    def __init__(self, i, o, bias=False, input_is_parallel=False, init_method=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(o, i // mp_size()))

    def forward(self, x):
        return _Reduce.apply(F.linear(x, self.weight))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), \
        torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


class Transformer(nn.Module):
    def __init__(self, parallel):
        super().__init__()
        lin = lambda i, o, **kw: nn.Linear(i, o, bias=False)  # noqa: E731
        col = (lambda i, o: ColumnParallelLinear(i, o, gather_output=False)) if parallel else lin
        row = (lambda i, o: RowParallelLinear(i, o, input_is_parallel=True)) if parallel else lin
        self.n_local_heads, self.head_dim = N_HEADS // (mp_size() if parallel else 1), DIM // N_HEADS
        self.tok_embeddings = ParallelEmbedding(VOCAB, DIM) if parallel else nn.Embedding(VOCAB, DIM)
        self.wq, self.wk, self.wv, self.wo = col(DIM, DIM), col(DIM, DIM), col(DIM, DIM), row(DIM, DIM)
        self.w1, self.w2, self.w3 = col(DIM, HIDDEN), row(HIDDEN, DIM), col(DIM, HIDDEN)
        self.attention_norm, self.ffn_norm, self.norm = RMSNorm(DIM), RMSNorm(DIM), RMSNorm(DIM)
        self.output = ColumnParallelLinear(DIM, VOCAB) if parallel else lin(DIM, VOCAB)

    def attention(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, seqlen, self.n_local_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        out = torch.matmul(F.softmax(scores, dim=-1), xv)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))

    def forward(self, tokens):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = precompute_freqs_cis(self.head_dim, 2 * seqlen)[:seqlen]
        mask = torch.triu(torch.full((1, 1, seqlen, seqlen), float("-inf")), diagonal=1)
        h = h + self.attention(self.attention_norm(h), freqs_cis, mask)
        n = self.ffn_norm(h)
        h = h + self.w2(F.silu(self.w1(n)) * self.w3(n))
        return self.output(self.norm(h))


def reference():
    return Transformer(parallel=False)


def rank_module(rank, world_size):
    initialize_model_parallel(MP)
    return Transformer(parallel=True)


SHARD_DIMS = {"tok_embeddings.weight": 1, "wq.weight": 0, "wk.weight": 0, "wv.weight": 0, "wo.weight": 1,
              "w1.weight": 0, "w2.weight": 1, "w3.weight": 0, "output.weight": 0}


def shard(state, rank, world_size):
    """Model parallel rank = rank % MP (consecutive ranks form a model-parallel group)."""
    return {k: (v.chunk(MP, SHARD_DIMS[k])[rank % MP] if k in SHARD_DIMS else v).clone()
            for k, v in state.items()}


def inputs():
    return {"tokens": torch.randint(0, VOCAB, (2, 6))}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
