"""Planted bugs for DTensor plans: a model-code mistake and a plan mistake.

The line that does the wrong thing carries `# planted: <name>`; a verifier should point at it.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, repeat_kv

from scalify.dtensor_plan import StyleSpec
from scalify.errors import ConfigError

DTENSOR_PLANTED_BUGS: dict[str, str] = {
    "dtensor-global-heads-reshape": "llama attention merges heads with the global head count, "
                                    "but q_proj's use_local_output=True gives it local heads",
    "dtensor-norm-not-sequence-parallel": "a sequence-parallel plan leaves "
                                          "post_attention_layernorm out",
}
NORM_LEFT_OUT = "model.layers.*.post_attention_layernorm"


class GlobalHeadsLlamaAttention(LlamaAttention):
    """LlamaAttention (eager) written for DTensor q/k/v, where views take global head counts."""

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        key, value = repeat_kv(key, self.num_key_value_groups), repeat_kv(value, self.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        heads_first = torch.matmul(weights, value)  # [batch, heads, seq, head_dim]
        heads_first = heads_first.view(input_shape[0], self.config.num_attention_heads, -1, self.head_dim)  # planted: dtensor-global-heads-reshape
        attn_output = heads_first.transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(attn_output), None


def _global_heads(model: nn.Module, entries: dict[str, StyleSpec]) -> dict[str, StyleSpec]:
    for module in model.modules():
        if type(module) is LlamaAttention:
            module.__class__ = GlobalHeadsLlamaAttention
    return entries


def _norm_left_out(model: nn.Module, entries: dict[str, StyleSpec]) -> dict[str, StyleSpec]:
    if entries.get(NORM_LEFT_OUT, StyleSpec("")).style != "SequenceParallel":
        raise ConfigError(f"planted bug dtensor-norm-not-sequence-parallel needs a plan with "
                          f"{NORM_LEFT_OUT}: SequenceParallel")
    return {glob: spec for glob, spec in entries.items()
            if glob != NORM_LEFT_OUT}  # planted: dtensor-norm-not-sequence-parallel


_PLANTERS = {"dtensor-global-heads-reshape": _global_heads,
             "dtensor-norm-not-sequence-parallel": _norm_left_out}


def plant(bug: str, model: nn.Module, entries: dict[str, StyleSpec]) -> dict[str, StyleSpec]:
    """Plant `bug` in `model` (in place) and return the plan entries to apply."""
    return _PLANTERS[bug](model, entries)
