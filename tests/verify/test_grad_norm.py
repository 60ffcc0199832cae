"""Gradient clipping over tensor parallelism, the way Megatron computes the norm: each rank sums
the squared norms of its gradients, counting a parameter every rank holds whole on rank 0 only,
and the sums are all-reduced. The reference takes the norm of the norms (PyTorch's clip). The
ranks' squared norms are squares of square roots of sums of squares, and the reference's norms
are gathered by data movement before they are squared again: both must be seen through."""
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import scalify

from .helpers import assert_caught, assert_verified

LINES = Path(__file__).read_text().splitlines()
COUNTED_WHERE = next(n for n, text in enumerate(LINES, 1) if text.endswith("# counted where"))

WORLD, HIDDEN, FFN, TOKENS, MAX_NORM = 2, 4, 8, 3, 0.05


class Block(nn.Module):
    """LayerNorm (every rank holds it whole), then a column-parallel linear on the ranks."""

    def __init__(self, rank: int | None = None, duplicates_on_every_rank: bool = False) -> None:
        super().__init__()
        self.rank = rank
        self.duplicates_on_every_rank = duplicates_on_every_rank
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, FFN if rank is None else FFN // WORLD)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = list(self.parameters())
        out = self.fc(self.norm(x))
        loss = ((out - target) ** 2).sum()
        grads = torch.autograd.grad(loss, params)
        if self.rank is not None:  # the LayerNorm's gradients and the loss are partial sums
            loss = loss.detach().clone()
            for value in (loss, *grads[:2]):
                dist.all_reduce(value)
        if self.rank is None:
            total = torch.stack([g.norm() for g in grads]).norm()
        else:
            norms = torch.zeros(())
            for param, grad in zip(params, grads):
                sharded = param is self.fc.weight or param is self.fc.bias
                if sharded or self.rank == 0 or self.duplicates_on_every_rank:  # counted where
                    norms = norms + grad.norm() ** 2
            dist.all_reduce(norms)
            total = norms.sqrt()
        coefficient = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        return (loss, *[g * coefficient for g in grads])


def _verify(duplicates_on_every_rank: bool) -> scalify.Report:
    torch.manual_seed(0)
    return scalify.verify_modules(
        reference=Block(),
        rank_module_factory=lambda rank: Block(rank, duplicates_on_every_rank), world_size=WORLD,
        example_inputs={"x": torch.randn(TOKENS, HIDDEN), "target": torch.randn(TOKENS, FFN)},
        param_placements={"fc.weight": scalify.Shard(0), "fc.bias": scalify.Shard(0)},
        input_placements={"target": scalify.Shard(1)},
        output_placements=[scalify.Replicate(), scalify.Replicate(), scalify.Replicate(),
                           scalify.Shard(0), scalify.Shard(0)],
        grad=True, numeric=True)


def test_a_norm_counting_whole_parameters_on_rank_zero_only_verifies():
    report = _verify(duplicates_on_every_rank=False)
    assert_verified(report)


def test_a_norm_counting_whole_parameters_on_every_rank_is_caught():
    report = _verify(duplicates_on_every_rank=True)
    assert_caught(report)
    assert (__file__, COUNTED_WHERE) in report.discrepancies[0].lines()


class Feedforward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ClippedStep(nn.Module):
    """The gradients clipped by PyTorch's own total norm; on the ranks they are DTensors (the
    row-parallel bias replicated: DTensor stacks its share of that norm with the partial ones)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = ((self.model(x) - target) ** 2).mean()
        grads = torch.autograd.grad(loss, list(self.model.parameters()))
        total = torch.nn.utils.get_total_norm(grads)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        coefficient = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        return (loss, *[g * coefficient for g in grads])


def _tensor_parallel_step(rank: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = parallelize_module(Feedforward(), mesh,
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return ClippedStep(model)


def test_pytorchs_total_norm_over_dtensor_gradients_verifies():
    report = scalify.verify_modules(
        reference=ClippedStep(Feedforward()), rank_module_factory=_tensor_parallel_step,
        world_size=WORLD,
        example_inputs={"x": torch.randn(2, TOKENS, HIDDEN),
                        "target": torch.randn(2, TOKENS, HIDDEN)},
        param_placements={"model.up.weight": scalify.Shard(0), "model.up.bias": scalify.Shard(0),
                          "model.down.weight": scalify.Shard(1)},
        output_placements=[scalify.Replicate(), scalify.Shard(0), scalify.Shard(0),
                           scalify.Shard(1), scalify.Replicate()],
        grad=True, numeric=True)
    assert_verified(report)
