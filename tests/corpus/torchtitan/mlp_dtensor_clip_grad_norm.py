"""torchtitan-style training step: a 2-layer MLP tensor-parallel with parallelize_module
(ColwiseParallel + RowwiseParallel) on a 1-D DeviceMesh, ending with torchtitan's
clip_grad_norm_ on the DTensor gradients."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import scalify

STYLE = "torchtitan"
STEP = "training"
WORLD_SIZE = 2
BUG = None

DIM, HIDDEN = 8, 16
MAX_NORM = 0.05


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    foreach: bool | None = None) -> torch.Tensor:
    """torchtitan.distributed.utils.clip_grad_norm_ (non-pipeline path), on a list of grads."""
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if isinstance(total_norm, DTensor):
        # Will reach here if any non-PP parallelism is used.
        # If only using PP, total_norm will be a local tensor.
        total_norm = total_norm.full_tensor()
    # torch.nn.utils.clip_grads_with_norm_
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for g in grads:
        g.mul_(clip_coef_clamped)
    return total_norm


class TrainStep(nn.Module):
    """The model wrapped with its loss, backward and gradient clipping."""

    def __init__(self, model: FeedForward):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        pred = self.model(x)
        loss = F.mse_loss(pred, target)
        params = [p for p in self.model.parameters()]
        grads = list(torch.autograd.grad(loss, params))
        clip_grad_norm_(grads, MAX_NORM)
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        return (loss, *grads)


def reference() -> nn.Module:
    return _Reference(FeedForward(DIM, HIDDEN))


class _Reference(nn.Module):
    def __init__(self, model: FeedForward):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        loss = F.mse_loss(self.model(x), target)
        grads = torch.autograd.grad(loss, list(self.model.parameters()))
        total_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        coef = torch.clamp(MAX_NORM / (total_norm + 1e-6), max=1.0)
        return (loss, *[g * coef for g in grads])


def _load_local_shards(module, state_dict, prefix, *args):
    """Checkpoint entries are this rank's local shards: wrap them as DTensors laid out like the
    parameters they load into."""
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        if isinstance(param, DTensor) and name in state_dict \
                and not isinstance(state_dict[name], DTensor):
            state_dict[name] = DTensor.from_local(state_dict[name], param.device_mesh,
                                                  param.placements, run_check=False)


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = FeedForward(DIM, HIDDEN)
    parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    step = TrainStep(model)
    step.register_load_state_dict_pre_hook(_load_local_shards)
    return step


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 4, DIM), "target": torch.randn(2, 4, DIM)}


PARAM_PLACEMENTS = {
    "model.w1.weight": scalify.Shard(0),
    "model.w1.bias": scalify.Shard(0),
    "model.w2.weight": scalify.Shard(1),
}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [
    scalify.Replicate(),   # loss
    scalify.Shard(0),      # w1.weight grad
    scalify.Shard(0),      # w1.bias grad
    scalify.Shard(1),      # w2.weight grad
    scalify.Replicate(),   # w2.bias grad
]
