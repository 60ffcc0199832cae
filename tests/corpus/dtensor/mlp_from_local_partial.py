"""Plain DTensor tensor-parallel MLP: local weight shards are wrapped with DTensor.from_local
(fc1 Shard(0), fc2 Shard(1)), fc1 runs as DTensor ops, fc2's local matmul is declared Partial
and redistributed to Replicate (all-reduce); fc2's bias is added after the reduction."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import scalify

STYLE = "dtensor"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

HIDDEN, FFN = 16, 32


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DTensorMLP(nn.Module):
    """Holds this rank's local shards as ordinary parameters (checkpoint-friendly) and builds
    DTensors over the mesh on the fly."""

    def __init__(self, hidden: int, ffn: int, mesh):
        super().__init__()
        self.mesh = mesh
        tp = mesh.size()
        self.fc1 = nn.Linear(hidden, ffn // tp)     # rows of fc1 (Shard(0))
        self.fc2 = nn.Linear(ffn // tp, hidden)     # columns of fc2 (Shard(1)); bias replicated

    def forward(self, x):
        x_dt = DTensor.from_local(x, self.mesh, [Replicate()])
        w1 = DTensor.from_local(self.fc1.weight, self.mesh, [Shard(0)])
        b1 = DTensor.from_local(self.fc1.bias, self.mesh, [Shard(0)])
        h = F.gelu(torch.matmul(x_dt, w1.t()) + b1, approximate="tanh")   # Shard(-1)
        assert h.placements[0] == Shard(h.ndim - 1), h.placements
        partial_out = torch.matmul(h.to_local(), self.fc2.weight.t())
        out = DTensor.from_local(partial_out, self.mesh, [Partial()])
        out = out.redistribute(self.mesh, [Replicate()]).to_local()
        return out + self.fc2.bias


def reference() -> nn.Module:
    return MLP(HIDDEN, FFN)


def rank_module(rank: int, world_size: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    return DTensorMLP(HIDDEN, FFN, mesh)


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 4, HIDDEN)}


PARAM_PLACEMENTS = {"fc1.weight": scalify.Shard(0), "fc1.bias": scalify.Shard(0),
                    "fc2.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
