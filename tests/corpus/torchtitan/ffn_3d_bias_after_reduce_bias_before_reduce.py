"""torchtitan-style tensor-parallel feed-forward on [bs, seqlen, dim] written with torch.einsum:
w1 column-parallel (sharded on its output dim), silu, w2 row-parallel (sharded on its input dim),
the partial sums reduced with funcol.all_reduce over the "tp" mesh. Bug: every rank adds the
replicated output bias to its partial sum before the all_reduce, so the reduced output carries
the bias tp times."""
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = "the row-parallel output bias is added on every rank before the all_reduce, so it is summed tp (2) times"


@dataclass
class ModelArgs:
    dim: int = 8
    hidden_dim: int = 16
    batch_size: int = 2
    seq_len: int = 4
    init_std: float = 0.02


class FeedForward(nn.Module):
    """FeedForward module

    Args:
        dim (int): Input dimension.
        hidden_dim (int): Hidden dimension of the feedforward layer.

    Attributes:
        w1 (nn.Parameter): [hidden_dim, dim], the input projection.
        w2 (nn.Parameter): [dim, hidden_dim], the output projection.
        b2 (nn.Parameter): [dim], the output bias.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(dim, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(torch.einsum("bsd,hd->bsh", x, self.w1))
        return torch.einsum("bsh,dh->bsd", h, self.w2) + self.b2

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.zeros_(self.b2)


class TensorParallelFeedForward(FeedForward):
    """The same FeedForward with w1 split along hidden_dim (Colwise) and w2 along hidden_dim
    (Rowwise): each rank produces a partial sum of the output, reduced over the tp mesh."""

    def __init__(self, dim: int, hidden_dim: int, tp_mesh: DeviceMesh):
        tp_size = tp_mesh.size()
        assert hidden_dim % tp_size == 0, f"hidden_dim {hidden_dim} not divisible by tp degree {tp_size}"
        super().__init__(dim, hidden_dim // tp_size)
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (bs, seqlen, dim), replicated over tp
        h = F.silu(torch.einsum("bsd,hd->bsh", x, self.w1))  # (bs, seqlen, hidden_dim / tp)
        out = torch.einsum("bsh,dh->bsd", h, self.w2)  # partial sum over the tp ranks
        out = out + self.b2  # BUG
        return funcol.all_reduce(out, "sum", self.tp_mesh)


def reference() -> nn.Module:
    model_args = ModelArgs()
    model = FeedForward(model_args.dim, model_args.hidden_dim)
    model.init_weights(model_args.init_std)
    return model


def rank_module(rank: int, world_size: int) -> nn.Module:
    model_args = ModelArgs()
    world_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = TensorParallelFeedForward(model_args.dim, model_args.hidden_dim, world_mesh["tp"])
    model.init_weights(model_args.init_std)
    return model


def inputs() -> dict[str, torch.Tensor]:
    model_args = ModelArgs()
    return {"x": torch.randn(model_args.batch_size, model_args.seq_len, model_args.dim)}


PARAM_PLACEMENTS = {"w1": scalify.Shard(0), "w2": scalify.Shard(1)}   # b2: Replicate
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
