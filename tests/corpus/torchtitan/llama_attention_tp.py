"""torchtitan Llama 3 attention sub-block (RMSNorm, GQA attention with RoPE, causal, residual),
tensor-parallel with parallelize_module: wq/wk/wv ColwiseParallel, wo RowwiseParallel."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

DIM, N_HEADS, N_KV_HEADS, SEQ = 16, 4, 2, 8


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)] / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs)
    # real form of torch.polar(ones, freqs): [end, dim // 2, 2] holding (cos, sin)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_emb(xq, xk, freqs_cis):
    def rotate(x):
        x_ = x.reshape(*x.shape[:-1], -1, 2)
        fc = freqs_cis.view(1, x_.shape[1], 1, x_.shape[3], 2)
        real = x_[..., 0] * fc[..., 0] - x_[..., 1] * fc[..., 1]
        imag = x_[..., 0] * fc[..., 1] + x_[..., 1] * fc[..., 0]
        return torch.stack([real, imag], dim=-1).flatten(3)
    return rotate(xq).type_as(xq), rotate(xk).type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1 so that the local number of heads is inferred under tensor parallelism
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, self.freqs_cis[:seqlen])
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class AttentionBlock(nn.Module):
    """The first half of torchtitan's TransformerBlock: h = x + attention(attention_norm(x))."""

    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention(DIM, N_HEADS, N_KV_HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x))


def _load_local_shards_hook(module, state_dict, prefix, *args):
    # checkpoint holds each rank's local shard: wrap it as a DTensor like the parameter
    for name, param in module.state_dict().items():
        key = prefix + name
        if isinstance(param, DTensor) and key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = DTensor.from_local(state_dict[key], param.device_mesh, param.placements,
                                                 run_check=False)


def reference() -> nn.Module:
    return AttentionBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = AttentionBlock()
    parallelize_module(model, tp_mesh, {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    })
    model.register_load_state_dict_pre_hook(_load_local_shards_hook)
    return model


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, SEQ, DIM)}


PARAM_PLACEMENTS = {"attention.wq.weight": scalify.Shard(0), "attention.wk.weight": scalify.Shard(0),
                    "attention.wv.weight": scalify.Shard(0), "attention.wo.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
