"""Distributed implementations under test: Megatron-style tensor-parallel Llama and GPT-2, one module per rank.

Rank modules are built on the meta device with local shapes and run under a (fake) process group
of `world_size` ranks; `param_placements` says how each local parameter relates to the reference's.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig

from scalify.errors import ConfigError
from scalify.parallel.fused import FUSED_PARTS
from scalify.parallel.gpt2 import GPT2Parts, build_gpt2_rank
from scalify.parallel.llama import LlamaParts, build_llama_rank
from scalify.parallel.planted import PLANTED_BUGS, PLANTED_PARTS, PLANTED_QKV_ROWS
from scalify.parallel.sharding import shard_fused_llama
from scalify.placements import Placement, Replicate

__all__ = ["LOGITS_MODES", "PLANTED_BUGS", "build_rank_model", "finalize_grads", "param_placements",
           "shard_function"]

LOGITS_MODES = ("gathered", "vocab_parallel")


@dataclass(frozen=True)
class _Family:
    build: Callable[..., nn.Module]
    correct_parts: LlamaParts | GPT2Parts


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(build_llama_rank, LlamaParts()),
    "gpt2": _Family(build_gpt2_rank, GPT2Parts()),
}


@runtime_checkable
class _ShardedLayer(Protocol):
    def placements(self) -> dict[str, Placement]: ...


def _parts(family: str, planted_bug: str | None, fused: bool = False) -> LlamaParts | GPT2Parts:
    """The layer classes for `family` (fused layouts: llama only), with `planted_bug` planted."""
    if family not in _FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; known: {', '.join(_FAMILIES)}")
    if fused and family != "llama":
        raise ConfigError(f"fused layouts exist for llama, not {family!r}")
    if planted_bug in PLANTED_QKV_ROWS and not fused:
        raise ConfigError(f"planted bug {planted_bug!r} is in the fused layout: set plan.fused: true")
    if planted_bug is None or planted_bug in PLANTED_QKV_ROWS:
        return FUSED_PARTS if fused else _FAMILIES[family].correct_parts
    if planted_bug not in PLANTED_PARTS:
        raise ConfigError(f"unknown planted bug {planted_bug!r}; known: {', '.join(PLANTED_BUGS)}")
    if fused:
        raise ConfigError(f"planted bug {planted_bug!r} exists for the unfused layout only")
    by_family = PLANTED_PARTS[planted_bug]
    if family not in by_family:
        raise ConfigError(f"planted bug {planted_bug!r} exists for {', '.join(by_family)}, not {family!r}")
    return by_family[family]


def build_rank_model(
    family: str,
    hf_config: PretrainedConfig,
    rank: int,
    world_size: int,
    *,
    logits: str = "gathered",
    planted_bug: str | None = None,
    sequence_parallel: bool = False,
    fused: bool = False,
) -> nn.Module:
    """Rank `rank` of `world_size`, on meta, in eval mode; forward(input_ids, attention_mask) -> logits.

    logits="gathered" returns [batch, seq, vocab]; "vocab_parallel" returns this rank's [batch, seq, vocab / n].
    `sequence_parallel` shards the activations between the tensor-parallel regions along the
    sequence (Megatron's sequence parallelism).
    `fused` builds Megatron's fused qkv_proj / gate_up_proj (llama), whose relations
    `shard_function` states.
    """
    parts = _parts(family, planted_bug, fused)
    if sequence_parallel:
        if fused:
            raise ConfigError("sequence parallelism is not built for the fused layout yet")
        if not isinstance(parts, LlamaParts):
            raise ConfigError(f"sequence parallelism is implemented for llama, not {family!r}")
        parts = replace(parts, sequence_parallel=True)
    if hf_config._attn_implementation != "eager":
        raise ConfigError("rank models mirror HF's eager attention: build the config with make_hf_config")
    if logits not in LOGITS_MODES:
        raise ConfigError(f"logits must be one of {', '.join(LOGITS_MODES)}, got {logits!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size} ranks")
    with torch.device("meta"):
        model = _FAMILIES[family].build(hf_config, rank, world_size, parts, gather_logits=logits == "gathered")
    return model.eval()


def param_placements(
    family: str, hf_config: PretrainedConfig, world_size: int, *, planted_bug: str | None = None
) -> dict[str, Placement]:
    """Placement of every reference parameter and buffer, by HF name (tied aliases such as lm_head.weight included)."""
    model = build_rank_model(family, hf_config, 0, world_size, planted_bug=planted_bug)
    placements: dict[str, Placement] = {}
    for module_name, module in model.named_modules():
        declared = module.placements() if isinstance(module, _ShardedLayer) else {}
        prefix = f"{module_name}." if module_name else ""
        local_tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, _ in local_tensors:
            placements[prefix + name] = declared.get(name, Replicate())
    return placements


def finalize_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank model's gradients after its plan's synchronisation (e.g. sequence-parallel norms)."""
    return model.finalize_grads(grads)


def shard_function(family: str, hf_config: PretrainedConfig, *, fused: bool = False,
                   path: str | None = None, planted_bug: str | None = None) -> Callable | None:
    """The sharding function that states a plan's relations: `path` ("module:function", given
    the HF config as `config=` when it takes one), else the fused layout's, else None (the
    layers' own placements)."""
    if path is not None:
        module_name, _, function_name = path.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ConfigError(f"plan.shard_fn: cannot load {path!r}: {error}") from None
        if "config" in inspect.signature(function).parameters:
            return functools.partial(function, config=hf_config)
        return function
    if not fused:
        return None
    _parts(family, planted_bug, fused)
    rows = PLANTED_QKV_ROWS.get(planted_bug or "")
    return functools.partial(shard_fused_llama, config=hf_config, **({"qkv_rows": rows} if rows else {}))
