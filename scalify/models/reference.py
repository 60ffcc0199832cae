"""Reference models: HuggingFace's own LlamaForCausalLM / GPT2LMHeadModel / MixtralForCausalLM,
built on the meta device (Mixtral's experts with the dense dispatch of `scalify.models.moe`)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM, PretrainedConfig)

from scalify.errors import ConfigError
from scalify.models.moe import DENSE_EXPERTS

_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "gpt2": GPT2Config,
                                               "mixtral": MixtralConfig}
_MODELS: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel,
                                       "mixtral": MixtralForCausalLM}
_EXTRA: dict[str, dict] = {"mixtral": {"experts_implementation": DENSE_EXPERTS}}


def _check_family(family: str) -> None:
    if family not in _CONFIGS:
        raise ConfigError(f"unknown model family {family!r}; known: {', '.join(_CONFIGS)}")


def make_hf_config(family: str, config: dict) -> PretrainedConfig:
    """The HF config for `config` (HF field names), with eager attention and no KV cache (MoE
    experts: the dense dispatch)."""
    _check_family(family)
    return _CONFIGS[family](**{**config, "attn_implementation": "eager", "use_cache": False,
                               **_EXTRA.get(family, {})})


def build_reference(family: str, hf_config: PretrainedConfig) -> nn.Module:
    """The HF causal-LM model for `hf_config`, on the meta device (no weights), in eval mode."""
    _check_family(family)
    with torch.device("meta"):
        model = _MODELS[family](hf_config)
    return model.eval()


def example_inputs(family: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Meta `input_ids` and an all-ones `attention_mask` (HF needs the mask on meta), both long [batch, seq]."""
    _check_family(family)
    shape = (batch, seq)
    return {
        "input_ids": torch.zeros(shape, dtype=torch.long, device="meta"),
        "attention_mask": torch.ones(shape, dtype=torch.long, device="meta"),
    }


def reference_forward(model: nn.Module) -> Callable[..., torch.Tensor]:
    """A function of (input_ids, attention_mask) returning the model's logits."""

    def logits(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    return logits
