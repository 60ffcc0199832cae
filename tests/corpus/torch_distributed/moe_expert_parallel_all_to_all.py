"""Hand-written expert-parallel top-1 MoE layer: a replicated router, experts split over an
expert-parallel group made with dist.new_group (2 local experts per rank), token counts exchanged
with all_to_all_single, tokens (and their expert ids) dispatched and combined with
all_to_all_single using variable split sizes; tokens are data-parallel (batch sharded)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

D_MODEL, D_FF, NUM_EXPERTS = 16, 32, 4


class MoE(nn.Module):
    def __init__(self, num_local_experts: int = NUM_EXPERTS, ep_group=None):
        super().__init__()
        self.ep_group = ep_group
        self.num_local_experts = num_local_experts
        self.router = nn.Linear(D_MODEL, NUM_EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_local_experts, D_MODEL, D_FF) * 0.2)
        self.w2 = nn.Parameter(torch.randn(num_local_experts, D_FF, D_MODEL) * 0.2)

    def experts(self, tokens: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.bmm(tokens.unsqueeze(1), self.w1[local_ids]))
        return torch.bmm(h, self.w2[local_ids]).squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, D_MODEL)
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, expert_ids = probs.max(dim=-1)
        if self.ep_group is None:
            out = self.experts(tokens, expert_ids)
        else:
            out = self.dispatch_combine(tokens, expert_ids)
        return (out * gate.unsqueeze(-1)).reshape(shape)

    def dispatch_combine(self, tokens, expert_ids):
        ep_size = dist.get_world_size(self.ep_group)
        ep_rank = dist.get_rank(self.ep_group)
        sort_idx = torch.argsort(expert_ids, stable=True)
        sorted_tokens, sorted_ids = tokens[sort_idx], expert_ids[sort_idx]
        tokens_per_expert = torch.bincount(expert_ids, minlength=NUM_EXPERTS)
        # how many tokens every rank sends to each of my local experts
        recv_per_expert = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=self.ep_group)
        input_splits = tokens_per_expert.view(ep_size, -1).sum(1).tolist()
        output_splits = recv_per_expert.view(ep_size, -1).sum(1).tolist()

        recv_tokens = sorted_tokens.new_empty(sum(output_splits), D_MODEL)
        dist.all_to_all_single(recv_tokens, sorted_tokens.contiguous(), output_splits, input_splits,
                               group=self.ep_group)
        recv_ids = sorted_ids.new_empty(sum(output_splits))
        dist.all_to_all_single(recv_ids, sorted_ids, output_splits, input_splits, group=self.ep_group)

        local_ids = recv_ids - ep_rank * self.num_local_experts
        expert_out = self.experts(recv_tokens, local_ids)

        combined = expert_out.new_empty(sorted_tokens.shape)
        dist.all_to_all_single(combined, expert_out.contiguous(), input_splits, output_splits,
                               group=self.ep_group)
        out = torch.empty_like(combined)
        out[sort_idx] = combined                 # undo the sort by expert
        return out


def reference() -> nn.Module:
    return MoE()


def rank_module(rank: int, world_size: int) -> nn.Module:
    ep_group = dist.new_group(ranks=list(range(world_size)))
    return MoE(num_local_experts=NUM_EXPERTS // world_size, ep_group=ep_group)


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 4, D_MODEL)}


PARAM_PLACEMENTS = {"w1": scalify.Shard(0), "w2": scalify.Shard(0)}
INPUT_PLACEMENTS = {"x": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
