"""Data parallelism and ZeRO: every rank runs the whole model on its slice of the batch.

A rank splits its slice into micro-batches and accumulates their gradients. The loss is
normalised by the target tokens of the whole global batch (counted once, all-reduced), so the
gradients are summed over the data-parallel group: by an all-reduce (plain data parallelism and
ZeRO-1, whose optimizer-state sharding does not change the gradients) or by a reduce-scatter
that leaves each rank its dim-0 shard of every gradient (ZeRO-2).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from scalify.errors import ShapeError
from scalify.placements import Placement, Replicate, Shard

IGNORE_INDEX = -100
BATCH_DIM = 0
ZERO_STAGES = (0, 1, 2)

Grads = list[torch.Tensor]


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many next-token targets HF's causal-LM loss counts in `labels` (ignored ones not)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    return (shifted != IGNORE_INDEX).sum()


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over the data-parallel group."""
    return funcol.all_reduce(tensor, "sum", dist.group.WORLD)


def scatter_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """This rank's dim-0 shard of the sum of `grad` over the group (ZeRO-2)."""
    return funcol.reduce_scatter_single(grad, "sum", BATCH_DIM, dist.group.WORLD)


def micro_batches(inputs: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """`inputs` cut into `count` equal micro-batches along the batch dim."""
    batch = next(iter(inputs.values())).shape[BATCH_DIM]
    if batch % count:
        raise ShapeError(f"a rank's batch of {batch} does not split into {count} micro-batches")
    pieces = {name: torch.chunk(tensor, count, BATCH_DIM) for name, tensor in inputs.items()}
    return [{name: parts[k] for name, parts in pieces.items()} for k in range(count)]


@dataclass(frozen=True)
class DataParallelStep:
    """One training step of a data-parallel rank: (loss, gradient of each parameter in `names`).

    `loss_of(model, inputs, tokens)` is a micro-batch's loss normalised by `tokens`;
    `accumulate` adds a micro-batch's gradients (index k) to the running sum and, after the last
    micro-batch, `sync`s them over the group (DDP's `no_sync` around the others). The defaults
    are the correct step; planted bugs replace one of them.
    """

    names: tuple[str, ...]
    micro_batches: int = 1
    zero_stage: int = 0

    def loss_of(self, model: nn.Module, inputs: dict[str, torch.Tensor],
                tokens: torch.Tensor) -> torch.Tensor:
        labels = inputs["labels"]
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits
        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=tokens)

    def accumulate(self, total: Grads | None, grads: Grads, index: int) -> Grads:
        summed = grads if total is None else [t + g for t, g in zip(total, grads)]
        return [self.sync(g) for g in summed] if index == self.micro_batches - 1 else summed

    def sync(self, grad: torch.Tensor) -> torch.Tensor:
        return scatter_over_ranks(grad) if self.zero_stage == 2 else sum_over_ranks(grad)

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        params = dict(model.named_parameters())
        wanted = [params[name] for name in self.names]
        parts = micro_batches(inputs, self.micro_batches)
        tokens = sum_over_ranks(functools.reduce(operator.add,
                                                 [target_tokens(part["labels"]) for part in parts]))
        loss_sum, grads = None, None
        for index, part in enumerate(parts):
            loss = self.loss_of(model, part, tokens)
            grads = self.accumulate(grads, list(torch.autograd.grad(loss, wanted)), index)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        return (sum_over_ranks(loss_sum), *grads)


def grad_placements(names: list[str], zero_stage: int) -> list[Placement]:
    """How each synchronised gradient relates to the reference's: whole on every rank, or its
    dim-0 shard under ZeRO-2."""
    return [Shard(0) if zero_stage == 2 else Replicate() for _ in names]

