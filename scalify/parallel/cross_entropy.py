"""Vocab-parallel cross-entropy: HF's causal-LM loss on logits whose classes are split across ranks.

Each rank holds the logits of classes [start, start + n). The loss needs three values over the
whole vocabulary, combined across ranks: the max (for a stable exponent), the sum of
exponentials, and the target's logit (picked by the one rank that holds the target's class).
Labels are shifted as HF shifts them, -100 is ignored, and the mean is over target tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from scalify.parallel.data import IGNORE_INDEX
from scalify.parallel.layers import all_reduce_sum


class VocabParallelCrossEntropy:
    """The loss of one rank's vocab-parallel logits; planted bugs override one step."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        classes = logits.shape[-1]
        start = dist.get_rank() * classes
        labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
        logits = logits.float().reshape(-1, classes)
        ignored = labels == IGNORE_INDEX
        target = labels.masked_fill(ignored, 0)
        shifted = logits - self.global_max(logits)
        log_sum_exp = self.sum_of_exp(shifted).log()
        losses = (log_sum_exp - self.target_logit(shifted, target, start)).masked_fill(ignored, 0.0)
        return self.mean(losses, labels)

    def global_max(self, logits: torch.Tensor) -> torch.Tensor:
        """The max logit of each token over the whole vocabulary (no gradient flows through it)."""
        return funcol.all_reduce(logits.amax(-1, keepdim=True).detach(), "max", dist.group.WORLD)

    def sum_of_exp(self, shifted: torch.Tensor) -> torch.Tensor:
        """Each token's sum of exponentials over the whole vocabulary."""
        return all_reduce_sum(shifted.exp().sum(-1))

    def outside(self, target: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """True where a token's target class belongs to another rank."""
        return (target < start) | (target >= end)

    def target_logit(self, shifted: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
        """Each token's shifted logit at its target class, picked by the rank holding it."""
        outside = self.outside(target, start, start + shifted.shape[-1])
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        return all_reduce_sum(picked)

    def mean(self, losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return losses.sum() / (labels != IGNORE_INDEX).sum()
