"""torchtitan Llama 3 attention under context parallelism (allgather rotate method): the
sequence is sharded over the "cp" mesh, freqs_cis is sharded along the sequence with it, K/V
are all-gathered along the sequence (DTensor Shard(1) -> Replicate) and the causal mask uses
global positions.
BUG: the rotary embedding takes positions 0..local_seqlen on every cp rank."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = "RoPE uses freqs_cis[:seqlen] with the local sequence length instead of the cp rank's shard of positions."

DIM, N_HEADS, N_KV_HEADS, SEQ = 16, 4, 2, 8


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end), freqs)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = x.reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, x_.shape[1], 1, x_.shape[3], 2)
    out = torch.stack([x_[..., 0] * fc[..., 0] - x_[..., 1] * fc[..., 1],
                       x_[..., 0] * fc[..., 1] + x_[..., 1] * fc[..., 0]], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cp_mesh=None):
        super().__init__()
        self.cp_mesh = cp_mesh
        self.n_rep = N_HEADS // N_KV_HEADS
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, SEQ), persistent=False)

    def _cp_shard(self, buffer: torch.Tensor, seq_dim: int) -> torch.Tensor:
        # context_parallel(buffers=[freqs_cis], buffer_seq_dims=[0]) shards the buffer in place
        if self.cp_mesh is None:
            return buffer
        return buffer.chunk(self.cp_mesh.size(), dim=seq_dim)[self.cp_mesh.get_local_rank()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, N_HEADS, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, N_KV_HEADS, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, N_KV_HEADS, self.head_dim)
        freqs_cis = self.freqs_cis[:seqlen]  # BUG
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)

        q_start = 0
        if self.cp_mesh is not None:
            # allgather rotate method: every cp rank sees the whole K/V sequence
            xk = DTensor.from_local(xk, self.cp_mesh, [Shard(1)]).redistribute(
                placements=[Replicate()]).to_local()
            xv = DTensor.from_local(xv, self.cp_mesh, [Shard(1)]).redistribute(
                placements=[Replicate()]).to_local()
            q_start = self.cp_mesh.get_local_rank() * seqlen
        q_pos = torch.arange(q_start, q_start + seqlen, device=x.device)
        k_pos = torch.arange(xk.shape[1], device=x.device)
        mask = q_pos[:, None] >= k_pos[None, :]

        keys = xk.repeat_interleave(self.n_rep, dim=2)
        values = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def reference() -> nn.Module:
    return Attention()


def rank_module(rank: int, world_size: int) -> nn.Module:
    world_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return Attention(cp_mesh=world_mesh["cp"])


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, SEQ, DIM)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"x": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
