"""What a verification runs: a model's forward (its logits), or one training step (the loss and
every parameter's gradient after the framework's gradient synchronisation)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

Run = Callable[[nn.Module, dict[str, torch.Tensor]], Any]
LossOf = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
Finalize = Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class Step(nn.Module):
    """`run(model, inputs)` as a module that keeps the model's parameter, buffer and module
    names (no wrapper prefix), so captured placeholders carry the model's own names."""

    def __init__(self, model: nn.Module, run: Run) -> None:
        super().__init__()
        self.model = model
        self.run = run

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.model.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any):
        return self.model.named_buffers(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any):
        return self.model.named_modules(*args, **kwargs)

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.run(self.model, inputs)


def hf_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A HuggingFace causal LM's logits."""
    return model(**inputs, use_cache=False).logits


def hf_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A HuggingFace causal LM's own loss on `inputs["labels"]`."""
    return model(**inputs, use_cache=False).loss


def keep_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """No gradient synchronisation (a single device)."""
    return grads


def training_step(loss_of: LossOf, names: list[str], finalize: Finalize = keep_grads,
                  holders: dict[str, str] | None = None) -> Run:
    """A run returning (loss, gradient of each parameter in `names`), the gradients taken
    after `finalize` (the framework's gradient sync: all-reduces over TP or DP groups).
    `holders` names, for each of `names`, the model parameter that holds it when the model's
    names differ (a fused `qkv_proj.weight` holds `q_proj.weight`): its gradient is returned."""
    held = [(holders or {}).get(name, name) for name in names]

    def run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        loss = loss_of(model, inputs)
        params = dict(model.named_parameters())
        own = list(dict.fromkeys(held))
        missing = [name for name in own if name not in params]
        if missing:
            raise KeyError(f"the model has no parameter named {missing[0]!r}")
        grads = torch.autograd.grad(loss, [params[name] for name in own], allow_unused=True)
        for name, grad in zip(own, grads):
            if grad is None:
                raise ValueError(f"the loss does not depend on parameter {name!r}")
        synced = finalize(model, dict(zip(own, grads)))
        return (loss, *(synced[name] for name in held))

    return run
