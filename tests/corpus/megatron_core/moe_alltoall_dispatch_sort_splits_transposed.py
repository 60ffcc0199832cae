"""Megatron-Core expert-parallel MoE with all-to-all dispatch -- BUG: the received tokens are
split for sort_chunks_by_idxs with the transposed (expert-major) token counts, so chunks are cut
at the wrong boundaries and tokens reach the wrong local expert."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "forward"
WORLD_SIZE = 2
BUG = 'The chunk sizes used to sort the received tokens by local expert are the transposed counts (num_global_tokens_per_local_expert.T), which belong to the restore step, so tokens are cut at wrong boundaries and processed by the wrong expert.'


@dataclass
class TransformerConfig:
    hidden_size: int = 16
    moe_ffn_hidden_size: int = 16
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    expert_model_parallel_size: int = 2


CONFIG = TransformerConfig()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        input = input.contiguous()
        output = input.new_empty(size=[sum(output_split_sizes)] + list(input.size()[1:]))
        dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _AllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
                None, None)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def gather_along_first_dim(input_, group):
    output = input_.new_empty([input_.size(0) * dist.get_world_size(group)] + list(input_.size()[1:]))
    dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    return output


def permute(tokens, indices):
    topk = indices.size(1)
    sorted_indices = torch.argsort(indices.view(-1), stable=True)
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def unpermute(permuted_tokens, sorted_indices, probs):
    topk = probs.size(1)
    unpermuted = permuted_tokens.new_zeros(sorted_indices.size(0), permuted_tokens.size(-1))
    unpermuted.index_copy_(0, sorted_indices, permuted_tokens)
    unpermuted = unpermuted.reshape(-1, topk, permuted_tokens.size(-1))
    return (unpermuted * probs.unsqueeze(-1)).sum(dim=1)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs):
    input = torch.split(input, split_sizes.tolist(), dim=0)
    return torch.cat([input[i] for i in sorted_idxs], dim=0)


class TopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.5)

    def forward(self, input):
        logits = F.linear(input.view(-1, input.size(-1)), self.weight)
        scores, top_indices = torch.topk(logits, k=self.topk, dim=1)
        return torch.softmax(scores, dim=-1), top_indices


class ExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.moe_ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(config.moe_ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class SequentialMLP(nn.Module):
    def __init__(self, num_local_experts, config):
        super().__init__()
        self.local_experts = nn.ModuleList([ExpertMLP(config) for _ in range(num_local_experts)])

    def forward(self, permuted_local_hidden_states, tokens_per_expert):
        chunks = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local_experts, chunks)], dim=0)


class MoELayer(nn.Module):
    def __init__(self, config=CONFIG):
        super().__init__()
        self.config = config
        self.ep_group = dist.new_group(list(range(config.expert_model_parallel_size)))
        self.ep_size = config.expert_model_parallel_size
        self.num_local_experts = config.num_moe_experts // self.ep_size
        offset = dist.get_rank(self.ep_group) * self.num_local_experts
        self.local_expert_indices = [offset + i for i in range(self.num_local_experts)]
        self.router = TopKRouter(config)
        self.experts = SequentialMLP(self.num_local_experts, config)
        input_chunk_idxs = torch.arange(config.num_moe_experts)
        self.sort_input_by_local_experts = input_chunk_idxs.reshape(-1, self.num_local_experts).T.ravel().tolist()
        self.restore_output_by_local_experts = input_chunk_idxs.reshape(self.num_local_experts, -1).T.ravel().tolist()

    def preprocess(self, indices):
        num_local_tokens_per_expert = torch.bincount(indices.view(-1), minlength=self.config.num_moe_experts)
        self.input_splits = num_local_tokens_per_expert.reshape(self.ep_size, self.num_local_experts).sum(1).tolist()
        num_global_tokens_per_expert = gather_along_first_dim(num_local_tokens_per_expert, self.ep_group)
        num_global_tokens_per_expert = num_global_tokens_per_expert.reshape(self.ep_size, -1)
        self.num_global_tokens_per_local_expert = num_global_tokens_per_expert[
            :, self.local_expert_indices[0]:self.local_expert_indices[-1] + 1]
        self.output_splits = self.num_global_tokens_per_local_expert.sum(dim=-1).tolist()
        return self.num_global_tokens_per_local_expert.sum(dim=0)

    def forward(self, hidden_states):
        # hidden_states: [s, b_local, h]
        hidden_shape = hidden_states.shape
        probs, indices = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        tokens_per_expert = self.preprocess(indices)
        permutated_local_input_tokens, reversed_mapping = permute(hidden_states, indices)
        global_input_tokens = all_to_all(self.ep_group, permutated_local_input_tokens,
                                         self.output_splits, self.input_splits)
        global_input_tokens = sort_chunks_by_idxs(
            global_input_tokens, self.num_global_tokens_per_local_expert.T.ravel(), self.sort_input_by_local_experts)  # BUG
        expert_output = self.experts(global_input_tokens, tokens_per_expert)
        expert_output = sort_chunks_by_idxs(
            expert_output, self.num_global_tokens_per_local_expert.T.ravel(), self.restore_output_by_local_experts)
        permutated_local_output = all_to_all(self.ep_group, expert_output, self.input_splits, self.output_splits)
        output = unpermute(permutated_local_output, reversed_mapping, probs)
        return output.view(hidden_shape)


class ReferenceMoE(nn.Module):
    def __init__(self, config=CONFIG):
        super().__init__()
        self.router = TopKRouter(config)
        self.experts = SequentialMLP(config.num_moe_experts, config)

    def forward(self, hidden_states):
        probs, indices = self.router(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.size(-1))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts.local_experts):
            token, slot = torch.nonzero(indices == e, as_tuple=True)
            out.index_add_(0, token, expert(x[token]) * probs[token, slot].unsqueeze(-1))
        return out.view(hidden_states.shape)


def reference() -> nn.Module:
    return ReferenceMoE()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return MoELayer()


def shard(state, rank, world_size):
    num_local = CONFIG.num_moe_experts // world_size
    out = {"router.weight": state["router.weight"].clone()}
    for i in range(num_local):
        for name in ("linear_fc1.weight", "linear_fc2.weight"):
            out[f"experts.local_experts.{i}.{name}"] = \
                state[f"experts.local_experts.{rank * num_local + i}.{name}"].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(4, 4, CONFIG.hidden_size)}   # [s, b, h]


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
