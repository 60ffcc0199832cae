"""A Llama-style transformer block, tensor parallel with torch's parallelize_module the way
torchtitan's apply_tp plans it, but wo's rowwise output is left Partial (never all-reduced)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = ("attention.wo keeps its output Partial, so the rank-local partial sums of the "
       "row-parallel projection enter the residual add without the all-reduce")

DIM = 16
N_HEADS = 4
FFN_HIDDEN = 32
NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        # under TP, self.n_heads is the rank's local head count (set by apply_tp)
        xq = xq.view(bs, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bs, seqlen, self.n_heads, self.head_dim)
        xv = xv.view(bs, seqlen, self.n_heads, self.head_dim)

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)

        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous()  # (bs, seqlen, n_local_heads, head_dim)
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = DIM, n_heads: int = N_HEADS, hidden_dim: int = FFN_HIDDEN):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = RMSNorm(dim, eps=NORM_EPS)
        self.ffn_norm = RMSNorm(dim, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


def _load_full_state_dict_pre_hook(module, state_dict, prefix, *args) -> None:
    """Full (unsharded) checkpoint tensors -> the DTensor layout parallelize_module gave each
    parameter, so a plain `load_state_dict` of the single-device weights works on the TP model."""
    for name, param in module.named_parameters():
        key = prefix + name
        if isinstance(param, DTensor) and key in state_dict \
                and not isinstance(state_dict[key], DTensor):
            state_dict[key] = distribute_tensor(state_dict[key], param.device_mesh,
                                                param.placements)


def apply_tp(model: TransformerBlock, tp_mesh: DeviceMesh) -> None:
    """torchtitan's per-block TP plan (no sequence parallel, no async TP, no float8)."""
    layer_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Partial()),  # BUG
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Replicate()),
        "feed_forward.w3": ColwiseParallel(),
    }

    # Adjust attention module to use the local number of heads
    attn_layer = model.attention
    attn_layer.n_heads = attn_layer.n_heads // tp_mesh.size()

    parallelize_module(module=model, device_mesh=tp_mesh, parallelize_plan=layer_plan)


def reference() -> nn.Module:
    return TransformerBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = TransformerBlock()
    apply_tp(model, tp_mesh)
    model.register_load_state_dict_pre_hook(_load_full_state_dict_pre_hook)
    return model


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 5, DIM)}


# The rank module takes the full single-device weights; parallelize_module (through the
# load pre-hook) shards them itself.
PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
