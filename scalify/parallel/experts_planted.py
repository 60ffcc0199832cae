"""Planted expert-parallel bugs: small variants of the expert-parallel Mixtral's modules.

The line that does the wrong thing carries `# planted: <name>`; a verifier should point at it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from scalify.models.moe import combine, expert_outputs
from scalify.parallel.experts import AllToAllExperts, ExpertParallelExperts, ExpertsClass
from scalify.parallel.layers import all_reduce_sum, copy_to_tensor_parallel, divide

EXPERT_PARALLEL_BUGS: dict[str, str] = {
    "ep-combine-weights-twice": "expert-parallel mixtral multiplies the experts' outputs by the "
                                "routing weights before combining them with the weights again",
    "ep-topk-local-experts": "expert-parallel mixtral's router takes the top-k over the rank's "
                             "own experts instead of all experts",
    "ep-wrong-split-sizes": "all-to-all expert-parallel mixtral (2 ranks): the combine's split "
                            "sizes move the token-block boundary by one, so each rank sums a "
                            "neighbour's token into its own block",
    "ep-router-grad-unreduced": "expert-parallel mixtral: the routing weights enter the experts "
                                "without Megatron's f, so the router's gradient keeps only the "
                                "rank's own experts' part (right forward, wrong training step)",
    "ep-a2a-token-grad-unreduced": "all-to-all expert-parallel mixtral: the tokens enter the "
                                   "experts without Megatron's f, so the gradient of the "
                                   "replicated layers below keeps only the rank's own token "
                                   "block (right forward, wrong training step)",
}


class WeightsTwiceExperts(ExpertParallelExperts):
    def exchange(self, tokens: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        weights = self.local_weights(top_k_index, top_k_weights)
        outputs = expert_outputs(self, tokens) * weights.transpose(0, 1).unsqueeze(-1)
        return all_reduce_sum(combine(outputs, weights))  # planted: ep-combine-weights-twice


class RouterGradUnreducedExperts(ExpertParallelExperts):
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens = copy_to_tensor_parallel(hidden_states)
        return self.exchange(tokens, top_k_index, top_k_weights).to(hidden_states.dtype)  # planted: ep-router-grad-unreduced


class TokenGradUnreducedAllToAllExperts(AllToAllExperts):
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        weights = copy_to_tensor_parallel(top_k_weights)
        return self.exchange(hidden_states, top_k_index, weights).to(hidden_states.dtype)  # planted: ep-a2a-token-grad-unreduced


class WrongSplitsAllToAllExperts(AllToAllExperts):
    def return_to_owners(self, partial: torch.Tensor, block: int) -> torch.Tensor:
        rank = dist.get_rank()
        splits = [block + 1 if peer == rank else block - 1 for peer in range(dist.get_world_size())]
        return funcol.all_to_all_single_autograd(partial, splits, splits, dist.group.WORLD)  # planted: ep-wrong-split-sizes


class LocalTopKRouter(MixtralTopKRouter):
    """HF's router whose top-k sees only this rank's experts."""

    def __init__(self, config: MixtralConfig, rank: int, world_size: int) -> None:
        super().__init__(config)
        self.local_experts = divide(self.num_experts, world_size, "num_local_experts")
        self.first_expert = rank * self.local_experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = nn.functional.linear(hidden_states, self.weight)
        router_probs = torch.softmax(router_logits.float(), dim=-1)
        local = slice(self.first_expert, self.first_expert + self.local_experts)
        top_value, top_index = torch.topk(router_probs[:, local], self.top_k, dim=-1)  # planted: ep-topk-local-experts
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value, top_index + self.first_expert


PLANTED_EXPERTS: dict[str, ExpertsClass] = {
    "ep-combine-weights-twice": WeightsTwiceExperts,
    "ep-wrong-split-sizes": WrongSplitsAllToAllExperts,
    "ep-router-grad-unreduced": RouterGradUnreducedExperts,
    "ep-a2a-token-grad-unreduced": TokenGradUnreducedAllToAllExperts,
}
PLANTED_ROUTERS = {"ep-topk-local-experts": LocalTopKRouter}
PLANTED_DISPATCH = {"ep-combine-weights-twice": "all_reduce", "ep-router-grad-unreduced": "all_reduce",
                    "ep-wrong-split-sizes": "all_to_all",
                    "ep-a2a-token-grad-unreduced": "all_to_all"}  # the dispatch each bug lives in
