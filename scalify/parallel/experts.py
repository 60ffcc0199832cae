"""Expert-parallel Mixtral, one rank: HuggingFace's MixtralForCausalLM with its experts sharded.

Rank r of n holds experts [r*E/n, (r+1)*E/n) (the Shard(0) slices of HF's fused 3-D expert
weights, under HF's parameter names); attention, norms, embeddings and the router are
replicated, and the router's top-k runs over all E experts on every rank. Each rank runs its
experts on every token, weighs their outputs by the tokens' routing weights (zero for experts a
token did not choose), and the ranks' partial outputs are summed with an all-reduce. In a
training step the gradients of the tokens and of their routing weights, partial on each rank
(its experts only), are all-reduced where they enter the experts (Megatron's f), so the
replicated parameters get whole gradients on every rank.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.activations import ACT2FN

from scalify.errors import ConfigError
from scalify.models.moe import combine, expert_outputs, routing_weights
from scalify.parallel.layers import all_gather_rows, all_reduce_sum, copy_to_tensor_parallel, divide
from scalify.placements import Placement, Replicate, Shard

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class ExpertParallelExperts(nn.Module):
    """This rank's experts (HF's `MixtralExperts` layout); forward sums all ranks' outputs."""

    def __init__(self, config: MixtralConfig, rank: int, world_size: int) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.local_experts = divide(self.num_experts, world_size, "num_local_experts")
        self.first_expert = rank * self.local_experts
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden, intermediate))
        self.act_fn = ACT2FN[config.hidden_act]

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def local_weights(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[tokens, local experts]: the routing weights of this rank's experts."""
        weights = routing_weights(top_k_index, top_k_weights, self.num_experts)
        return weights[:, self.first_expert:self.first_expert + self.local_experts]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, weights = copy_to_tensor_parallel(hidden_states), copy_to_tensor_parallel(top_k_weights)
        return self.exchange(tokens, top_k_index, weights).to(hidden_states.dtype)

    def exchange(self, tokens: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every token's output summed over all ranks' experts."""
        weights = self.local_weights(top_k_index, top_k_weights)
        return all_reduce_sum(combine(expert_outputs(self, tokens), weights))

    def placements(self) -> dict[str, Placement]:
        return {name: Shard(0) for name in EXPERT_WEIGHTS}


class AllToAllExperts(ExpertParallelExperts):
    """The same experts, with the tokens dispatched and combined by all-to-all.

    Rank r owns token block r (tokens split evenly over the ranks). Dispatch: it sends its
    tokens to every rank, which runs its experts on all tokens it received, weighted by the
    routing weights (the router is replicated, so every rank has them for all tokens). Combine:
    each rank sends every token's partial output back to the token's owner, which sums them;
    an all-gather rebuilds the whole sequence for the replicated layers that follow.
    """

    def exchange(self, tokens: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        block = divide(tokens.shape[0], world, "tokens (batch * seq)")
        own = tokens[rank * block:(rank + 1) * block]
        received = self.dispatch(torch.cat([own] * world, dim=0))
        partial = combine(expert_outputs(self, received), self.local_weights(top_k_index, top_k_weights))
        summed = self.return_to_owners(partial, block).view(world, block, -1).sum(dim=0)
        return all_gather_rows(summed)

    def return_to_owners(self, partial: torch.Tensor, block: int) -> torch.Tensor:
        """Every token's partial output back to the rank owning its block (`block` tokens each)."""
        return self.dispatch(partial)

    def dispatch(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block e of `blocks` (equal row blocks) to rank e; block s of the result from rank s."""
        return funcol.all_to_all_single_autograd(blocks, None, None, dist.group.WORLD)


ExpertsClass = Callable[[MixtralConfig, int, int], nn.Module]


def build_mixtral_ep_rank(config: MixtralConfig, rank: int, world_size: int,
                          experts: ExpertsClass = ExpertParallelExperts,
                          router: Callable[[MixtralConfig, int, int], nn.Module] | None = None
                          ) -> MixtralForCausalLM:
    """Rank `rank` of `world_size` expert-parallel ranks, on meta, in eval mode; `experts` and
    `router` (default: HF's) build each layer's expert and router modules."""
    if config.model_type != "mixtral":
        raise ConfigError(f"expert parallelism is built for mixtral, not {config.model_type!r}")
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
        for layer in model.model.layers:
            layer.mlp.experts = experts(config, rank, world_size)
            if router is not None:
                layer.mlp.gate = router(config, rank, world_size)
    return model.eval()


DISPATCHES: dict[str, ExpertsClass] = {"all_reduce": ExpertParallelExperts,
                                       "all_to_all": AllToAllExperts}


def expert_parallel_rank(config: MixtralConfig, rank: int, world_size: int,
                         planted_bug: str | None = None,
                         dispatch: str = "all_reduce") -> MixtralForCausalLM:
    """Rank `rank` of the expert-parallel Mixtral, tokens dispatched by `dispatch` (a key of
    DISPATCHES), with `planted_bug` (an `ep-*` bug) planted."""
    from scalify.parallel.experts_planted import (EXPERT_PARALLEL_BUGS, PLANTED_DISPATCH,
                                                  PLANTED_EXPERTS, PLANTED_ROUTERS)

    if planted_bug is not None and planted_bug not in EXPERT_PARALLEL_BUGS:
        raise ConfigError(f"unknown expert-parallel planted bug {planted_bug!r}; known: "
                          f"{', '.join(EXPERT_PARALLEL_BUGS)}")
    if planted_bug in PLANTED_DISPATCH and dispatch != PLANTED_DISPATCH[planted_bug]:
        raise ConfigError(f"planted bug {planted_bug!r} is in the "
                          f"{PLANTED_DISPATCH[planted_bug]} dispatch: set plan.expert_dispatch")
    experts = PLANTED_EXPERTS.get(planted_bug or "", DISPATCHES[dispatch])
    return build_mixtral_ep_rank(config, rank, world_size, experts,
                                 PLANTED_ROUTERS.get(planted_bug or ""))


def expert_placements(config: MixtralConfig, world_size: int) -> dict[str, Placement]:
    """Placement of every reference parameter by HF name: expert weights Shard(0), the rest
    Replicate."""
    placements: dict[str, Placement] = {}
    for module_name, module in build_mixtral_ep_rank(config, 0, world_size).named_modules():
        declared = module.placements() if isinstance(module, ExpertParallelExperts) else {}
        for name, _ in module.named_parameters(recurse=False):
            placements[f"{module_name}.{name}" if module_name else name] = declared.get(name, Replicate())
    return placements
