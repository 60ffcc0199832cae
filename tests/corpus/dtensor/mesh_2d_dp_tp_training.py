"""2-D DeviceMesh (dp=2, tp=2) training step on 4 ranks: the batch is laid out with
distribute_tensor(x, mesh, [Shard(0), Replicate()]), the MLP is tensor-parallel over mesh["tp"]
(fc1 Shard(0), fc2 Shard(1) local shards wrapped with DTensor.from_local), gradients are averaged
by hand over the "dp" process group and gathered over "tp" for the optimizer's global view."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import scalify

STYLE = "dtensor"
STEP = "training"
WORLD_SIZE = 4
BUG = None

HIDDEN, FFN, SEQ, BATCH = 8, 16, 4, 4
# parameter -> its tensor-parallel placement over mesh["tp"]
TP_PLAN = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1), "fc2.bias": Replicate()}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x, y):
        out = self.fc2(F.gelu(self.fc1(x)))
        loss = F.mse_loss(out, y)
        params = [p for n, p in self.named_parameters()]
        return (loss, *torch.autograd.grad(loss, params))


class MLP2D(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh, self.tp_mesh = mesh, mesh["tp"]
        tp = self.tp_mesh.size()
        self.fc1 = nn.Linear(HIDDEN, FFN // tp)
        self.fc2 = nn.Linear(FFN // tp, HIDDEN)

    def forward(self, x, y):
        x = distribute_tensor(x, self.mesh, [Shard(0), Replicate()]).to_local()
        y = distribute_tensor(y, self.mesh, [Shard(0), Replicate()]).to_local()
        names = list(TP_PLAN)
        local = dict(self.named_parameters())
        p = {n: DTensor.from_local(local[n], self.tp_mesh, [TP_PLAN[n]]) for n in names}
        x_dt = DTensor.from_local(x, self.tp_mesh, [Replicate()])
        h = F.gelu(x_dt @ p["fc1.weight"].t() + p["fc1.bias"])
        out = h @ p["fc2.weight"].t() + p["fc2.bias"]
        loss = F.mse_loss(out, DTensor.from_local(y, self.tp_mesh, [Replicate()])).to_local()
        grads = list(torch.autograd.grad(loss, [local[n] for n in names]))

        dp_group = self.mesh.get_group("dp")
        dp_size = self.mesh["dp"].size()
        for g in grads:
            dist.all_reduce(g, group=dp_group)
            g.div_(dp_size)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_size
        full = [DTensor.from_local(g, self.tp_mesh, [TP_PLAN[n]]).full_tensor() for n, g in zip(names, grads)]
        return (loss, *full)


def reference() -> nn.Module:
    return MLP()


def rank_module(rank: int, world_size: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    return MLP2D(mesh)


def shard(state, rank, world_size):
    tp_rank, tp = rank % 2, 2           # mesh (dp, tp): rank = dp_rank * tp + tp_rank
    return {n: t.chunk(tp, TP_PLAN[n].dim)[tp_rank].clone() if isinstance(TP_PLAN[n], Shard) else t.clone()
            for n, t in state.items()}


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(BATCH, SEQ, HIDDEN), "y": torch.randn(BATCH, SEQ, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
