"""A dense, capturable dispatch for HuggingFace's MoE experts, registered as an HF experts
implementation ("scalify_dense").

HF's eager dispatch (`MixtralExperts.forward`) loops over `nonzero()` experts and gathers their
tokens with `torch.where`/`index_add_`: token counts are data, so it cannot run on the meta
device. The dense dispatch runs every expert on every token and weighs each expert's output by
the token's routing weight (zero for experts outside the token's top-k): the same sum over the
top-k experts, with static shapes. The router (softmax, top-k, renormalisation) stays HF's.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

DENSE_EXPERTS = "scalify_dense"


def routing_weights(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    num_experts: int) -> torch.Tensor:
    """[tokens, num_experts]: each token's routing weight per expert, zero outside its top-k."""
    experts = torch.arange(num_experts, device=top_k_index.device)
    chosen = top_k_index.unsqueeze(-1) == experts  # [tokens, k, experts]
    return (chosen * top_k_weights.unsqueeze(-1)).sum(dim=1)


def expert_outputs(experts: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """[experts, tokens, hidden]: every expert's gated MLP applied to every token."""
    gate_up = torch.matmul(hidden_states, experts.gate_up_proj.transpose(1, 2))
    return torch.matmul(experts._apply_gate(gate_up), experts.down_proj.transpose(1, 2))


def combine(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[tokens, hidden]: the experts' outputs [experts, tokens, hidden] summed with `weights`
    [tokens, experts]."""
    return (outputs * weights.transpose(0, 1).unsqueeze(-1)).sum(dim=0)


def dense_experts_forward(experts: nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward signature: [tokens, hidden] in and out."""
    weights = routing_weights(top_k_index, top_k_weights, experts.num_experts)
    return combine(expert_outputs(experts, hidden_states), weights).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(DENSE_EXPERTS, dense_experts_forward)
