"""DTensor tensor-parallel SwiGLU MLP built with distribute_tensor from full replicated weights,
where the stacked gate/up weight [2, ffn, hidden] is distributed along its stacking dim (Shard(0))
instead of its ffn dim, so one rank computes with gate rows only and the other with up rows."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import scalify

STYLE = "dtensor"
STEP = "forward"
WORLD_SIZE = 2
BUG = "gate_up_proj is distributed with Shard(0) (the gate/up stacking dim) instead of Shard(1)."

HIDDEN, FFN = 8, 16


class SwiGLUMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, FFN, HIDDEN) * HIDDEN ** -0.5)
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        gate = F.linear(x, self.gate_up_proj[0])
        up = F.linear(x, self.gate_up_proj[1])
        return self.down_proj(F.silu(gate) * up)


class TPSwiGLUMLP(nn.Module):
    """Keeps the full weights (same names and shapes as the checkpoint) and shards them over the
    mesh with distribute_tensor, computing on the local shards."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.gate_up_proj = nn.Parameter(torch.empty(2, FFN, HIDDEN))
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        gate_up = distribute_tensor(self.gate_up_proj, self.mesh, [Shard(0)]).to_local()  # BUG
        down = distribute_tensor(self.down_proj.weight, self.mesh, [Shard(1)]).to_local()
        # [2, ffn/tp, hidden] -> one [2*ffn/tp, hidden] matmul: [gate_local | up_local]
        gate, up = F.linear(x, gate_up.flatten(0, 1)).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, down)
        dist.all_reduce(out, group=self.mesh.get_group())
        return out + self.down_proj.bias


def reference():
    return SwiGLUMLP()


def rank_module(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    return TPSwiGLUMLP(mesh)


def inputs():
    return {"x": torch.randn(2, 3, HIDDEN)}


PARAM_PLACEMENTS = {}   # every rank loads the full weights; distribute_tensor shards them
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
