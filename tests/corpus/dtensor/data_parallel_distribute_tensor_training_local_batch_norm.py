"""DTensor-native data parallel training step: rank 0's batch is scattered with
distribute_tensor(..., [Shard(0)]), the weights enter as Replicate DTensors (from_local), the
loss is a DTensor reduced with full_tensor(), and autograd all-reduces the Partial weight
gradients back to Replicate.
BUG: the loss is divided by the local (per-rank) batch size rather than the global batch size."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import scalify

STYLE = "dtensor"
STEP = "training"
WORLD_SIZE = 2
BUG = "The summed loss is normalised by the local batch size instead of the global one, scaling loss and gradients by world_size."

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def predict(self, x, params):
        h = F.linear(x, params["proj.weight"], params["proj.bias"])
        h = F.layer_norm(F.gelu(h), (HIDDEN,), params["norm.weight"], params["norm.bias"])
        return F.linear(h, params["head.weight"], params["head.bias"])

    def forward(self, x, y):
        params = dict(self.named_parameters())
        pred = self.predict(x, params)
        loss = ((pred - y) ** 2).sum() / (x.shape[0] * OUT)
        return (loss, *torch.autograd.grad(loss, list(params.values())))


class DTensorDataParallel(Regressor):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x, y):
        # the data loader runs on rank 0; distribute_tensor scatters the batch
        x_dt = distribute_tensor(x, self.mesh, [Shard(0)], src_data_rank=0)
        y_dt = distribute_tensor(y, self.mesh, [Shard(0)], src_data_rank=0)
        local_params = dict(self.named_parameters())
        params = {name: DTensor.from_local(p, self.mesh, [Replicate()]) for name, p in local_params.items()}
        pred = self.predict(x_dt, params)                       # Shard(0)
        loss = ((pred - y_dt) ** 2).sum() / (x_dt.to_local().shape[0] * OUT)  # BUG
        loss = loss.full_tensor()
        grads = torch.autograd.grad(loss, list(local_params.values()))
        return (loss, *grads)


def reference() -> nn.Module:
    return Regressor()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DTensorDataParallel(init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(BATCH, IN), "y": torch.randn(BATCH, OUT)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * (1 + 6)
