"""Ranks of a HuggingFace model parallelised by torch's `parallelize_module` from a DTensor plan.

Each rank is the reference model itself (meta weights), parallelised over a 1-D CPU device mesh
inside the rank's fake process group; placements are read back from its DTensor parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from scalify.capture.ranks import fake_process_group
from scalify.dtensor_plan import HF_STYLES, DTensorPlan, Layout, StyleSpec
from scalify.errors import ConfigError
from scalify.models import build_reference
from scalify.parallel.dtensor_planted import DTENSOR_PLANTED_BUGS, plant
from scalify.placements import Placement, Replicate, Shard

_CLASSES: dict[str, type[ParallelStyle]] = {
    "ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
    "SequenceParallel": SequenceParallel, "PrepareModuleInput": PrepareModuleInput,
    "PrepareModuleOutput": PrepareModuleOutput,
}
LOGITS_MODULE = "lm_head"


def torch_layout(layout: Layout) -> TorchReplicate | TorchShard | None:
    """The torch placement for a plan layout."""
    if layout is None:
        return None
    return TorchShard(layout.dim) if isinstance(layout, Shard) else TorchReplicate()


def _torch_option(value: object) -> object:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # kwarg layouts
        return {name: torch_layout(layout) for name, layout in value}
    if isinstance(value, tuple):
        return tuple(torch_layout(layout) for layout in value)
    if isinstance(value, (Replicate, Shard)):
        return torch_layout(value)
    return value


def torch_style(spec: StyleSpec) -> ParallelStyle:
    """The `torch.distributed.tensor.parallel` style a plan entry names."""
    return _CLASSES[spec.style](**{name: _torch_option(v) for name, v in spec.options})


def hf_plan(model: nn.Module) -> dict[str, StyleSpec]:
    """HuggingFace's own plan: the model's `_tp_plan`, which HF fills from the class's entries
    (lm_head) and the config's `base_model_tp_plan` (under the base model's prefix)."""
    entries = getattr(model, "_tp_plan", None) or {}
    if not entries:
        raise ConfigError(f"{type(model).__name__} has no HuggingFace tensor-parallel plan: "
                          "write the dtensor_plan as a mapping")
    unknown = sorted({name for name in entries.values() if name not in HF_STYLES})
    if unknown:
        raise ConfigError(f"HuggingFace plan styles {unknown} have no DTensor equivalent here "
                          f"(known: {', '.join(HF_STYLES)})")
    return {glob: HF_STYLES[name] for glob, name in entries.items()}


def _matches(glob: str, name: str) -> bool:
    """parallelize_module's matching: one fnmatch per dotted part."""
    parts, names = glob.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch(n, p) for n, p in zip(names, parts))


def model_plan(model: nn.Module, plan: DTensorPlan) -> dict[str, StyleSpec]:
    """The plan's entries for `model`; an entry that matches no module is an error."""
    entries = hf_plan(model) if plan.hf else dict(plan.entries)
    names = [name for name, _ in model.named_modules() if name]
    for glob in entries:
        if not any(_matches(glob, name) for name in names):
            raise ConfigError(f"dtensor_plan entry {glob!r} matches no module of "
                              f"{type(model).__name__}")
    return entries


def logits_placement(entries: dict[str, StyleSpec]) -> Placement:
    """How the ranks' logits relate to the reference's: the lm_head style's output layout."""
    spec = entries.get(LOGITS_MODULE)
    if spec is None:
        return Replicate()
    layout = spec.option("output_layouts") or spec.option("desired_output_layouts")
    if spec.style in ("ColwiseParallel", "RowwiseParallel") and layout is None:
        layout = Shard(-1) if spec.style == "ColwiseParallel" else Replicate()
    layout = layout[0] if isinstance(layout, tuple) else layout
    return layout if isinstance(layout, Shard) else Replicate()


def build_dtensor_rank(family: str, hf_config: PretrainedConfig, plan: DTensorPlan, world_size: int,
                       planted_bug: str | None = None) -> nn.Module:
    """This rank's HF model on meta, parallelised (call inside the rank's process group)."""
    model = build_reference(family, hf_config)
    entries = model_plan(model, plan)
    if planted_bug is not None:
        entries = plant(planted_bug, model, entries)
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(model, mesh, {glob: torch_style(spec) for glob, spec in entries.items()})
    return model


def dtensor_placements(model: nn.Module) -> dict[str, Placement]:
    """Each parameter's and buffer's placement, read from its DTensor (plain tensors: Replicate)."""
    placements: dict[str, Placement] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        placement = tensor.placements[0] if isinstance(tensor, DTensor) else None
        if isinstance(placement, TorchShard):
            placements[name] = Shard(placement.dim)
        elif placement is None or placement.is_replicate():
            placements[name] = Replicate()
        else:
            raise ConfigError(f"{name}: placement {placement} of a parameter is not supported")
    return placements


@dataclass(frozen=True)
class DTensorSubject:
    """What verification needs of a DTensor-parallel model: each rank's HF model, the
    parameters' placements (by HF name) and the logits' placement."""

    rank_factory: Callable[[int], nn.Module]
    param_placements: dict[str, Placement]
    logits: Placement


def dtensor_subject(family: str, hf_config: PretrainedConfig, plan: DTensorPlan, world_size: int,
                    planted_bug: str | None = None) -> DTensorSubject:
    """Rank factory and placements for `plan` applied to the HF model of `hf_config`."""
    if planted_bug is not None and planted_bug not in DTENSOR_PLANTED_BUGS:
        raise ConfigError(f"unknown planted bug {planted_bug!r} for style dtensor; known: "
                          f"{', '.join(DTENSOR_PLANTED_BUGS)}")

    def rank_factory(rank: int) -> nn.Module:
        return build_dtensor_rank(family, hf_config, plan, world_size, planted_bug)

    model = build_reference(family, hf_config)
    logits = logits_placement(model_plan(model, plan))
    with fake_process_group(0, world_size):
        placements = dtensor_placements(rank_factory(0))
    return DTensorSubject(rank_factory, placements, logits)


def parameter_layout_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's gradient sync: DTensor gradients redistributed to their parameters' layouts
    (partial sums all-reduced, as an optimizer step needs them), as this rank's local tensors."""
    params = dict(model.named_parameters())

    def local(name: str, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            return grad
        return grad.redistribute(grad.device_mesh, params[name].placements).to_local()

    return {name: local(name, grad) for name, grad in grads.items()}
