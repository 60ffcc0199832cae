"""Plain torch.distributed column-parallel projection with gathered output (all_gather into a list
of column views of one preallocated buffer, then a replicated LayerNorm and head), where the view
list is reversed so each rank's slice lands in the other rank's columns."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 2
BUG = "The gather's output views are in reverse rank order, so the ranks' feature blocks are swapped."

IN, FFN, OUT = 8, 12, 6


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(IN, FFN)
        self.norm = nn.LayerNorm(FFN)
        self.head = nn.Linear(FFN, OUT)

    def forward(self, x):
        return self.head(self.norm(F.gelu(self.up(x))))


def gather_last_dim_into(local: torch.Tensor, world_size: int) -> torch.Tensor:
    """all_gather without a concat: the received slices land in views of one buffer."""
    out = torch.empty(*local.shape[:-1], local.shape[-1] * world_size,
                      dtype=local.dtype, device=local.device)
    parts = list(out.chunk(world_size, dim=-1))[::-1]  # BUG
    dist.all_gather(parts, local.contiguous())
    return out


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, world_size):
        super().__init__()
        self.world_size = world_size
        self.weight = nn.Parameter(torch.empty(out_features // world_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // world_size))

    def forward(self, x):
        local = F.linear(x, self.weight, self.bias)
        return gather_last_dim_into(local, self.world_size)


class ParallelProjection(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.up = ColumnParallelLinear(IN, FFN, world_size)
        self.norm = nn.LayerNorm(FFN)
        self.head = nn.Linear(FFN, OUT)

    def forward(self, x):
        return self.head(self.norm(F.gelu(self.up(x))))


def reference():
    return Projection()


def rank_module(rank, world_size):
    return ParallelProjection(world_size)


def inputs():
    return {"x": torch.randn(2, 3, IN)}


PARAM_PLACEMENTS = {"up.weight": scalify.Shard(0), "up.bias": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
