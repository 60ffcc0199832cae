"""torchtitan-style MoE layer with expert parallelism (EP=2, 4 experts, top-2): a replicated
TokenChoiceTopKRouter (linear gate, softmax scores, top-2), a TokenReorderer (argsort of the
token-slots by expert id, bincount of tokens per expert), GroupedExperts holding stacked SwiGLU
weights w1/w2/w3 of shape [num_experts, ...] sharded on dim 0 (2 local experts per rank), and an
ExpertParallel style whose token dispatch exchanges the counts with all_to_all_single, sends the
token copies with all_to_all_single on those splits and regroups them by local expert, and whose
token combine undoes that; the routed outputs are weighted by the router scores and summed back
per token with scatter_add. Tokens are data-parallel: each rank routes its own batch shard."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = None


@dataclass
class MoEArgs:
    num_experts: int = 4
    top_k: int = 2
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0


DIM = 16
MOE_HIDDEN_DIM = 16
INIT_STD = 0.3
MOE_ARGS = MoEArgs()


def _run_experts_for_loop(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    # NOTE: this would incur a synchronization between device and host
    num_tokens_per_expert = num_tokens_per_expert.tolist()

    # a tuple of tensors indexed by experts
    # each with shape (tokens_per_expert(varying), dim)
    x = torch.split(x, split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx]))
        h = h * torch.matmul(x_expert, w3[expert_idx])
        h = torch.matmul(h, w2[expert_idx])
        # h shape (tokens_per_expert(varying), dim)
        out_experts_splits.append(h)
    return torch.cat(out_experts_splits, dim=0)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.init_weights(INIT_STD)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


class TokenChoiceTopKRouter(nn.Module):
    """Each token chooses its top_k experts; the scores of the chosen experts are returned."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        Args:
            x (torch.Tensor): Input tensor with shape ``(bs*slen, dim)``.

        Returns:
            top_scores: ``(bs*slen, top_k)``, the routing scores of the selected experts.
            selected_experts_indices: ``(bs*slen, top_k)``, the selected expert ids.
            num_tokens_per_expert: ``(num_experts,)``, token-slots routed to each expert.
        """
        # scores shape (bs*slen, num_experts)
        scores = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores)
        elif self.score_func == "softmax":
            scores = F.softmax(scores, dim=1)
        else:
            raise NotImplementedError(f"Unknown score function {self.score_func}")

        # top scores shape (bs*slen, top_k)
        _, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)

        if self.route_norm:
            denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
            top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale

        num_tokens_per_expert = torch.bincount(
            selected_experts_indices.view(-1), minlength=self.num_experts
        )
        return top_scores, selected_experts_indices, num_tokens_per_expert


class TokenReorderer(nn.Module):
    """Sorts the token-slots by their expert id so every expert's tokens are contiguous."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        num_tokens_per_expert = torch.bincount(
            selected_experts_indices.view(-1), minlength=self.num_experts
        )
        # Reorder the token indices to match the order of the experts
        # token_indices_experts_sorted shape (bs*slen*top_k,)
        token_indices_experts_sorted = torch.argsort(
            selected_experts_indices.view(-1), stable=True
        )
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        num_experts = moe_args.num_experts
        self.experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=num_experts,
            top_k=moe_args.top_k,
            score_func=moe_args.score_func,
            route_norm=moe_args.route_norm,
            route_scale=moe_args.route_scale,
        )
        self.reorderer = TokenReorderer(num_experts=num_experts, top_k=moe_args.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): Input tensor with shape ``(bs, slen, dim)``.

        Returns:
            out (torch.Tensor): Output tensor with shape ``(bs, slen, dim)``.
        """
        bs, slen, dim = x.shape
        x = x.view(-1, dim)

        # top_scores and selected_experts_indices shape (bs*slen, top_k)
        top_scores, selected_experts_indices, _ = self.router(x)

        (
            top_scores_experts_sorted,
            token_indices_experts_sorted,
            num_tokens_per_expert,
        ) = self.reorderer(top_scores, selected_experts_indices)

        # shape (bs*slen*top_k, dim)
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)

        # shape (bs*slen*top_k, dim)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        routed_output = routed_output * top_scores_experts_sorted.reshape(-1, 1)

        out = torch.zeros_like(x)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


# --------------------------------------------------------------------------------------------
# Expert parallel
# --------------------------------------------------------------------------------------------


def generate_permute_indices(
    tokens_per_expert_group: torch.Tensor, experts_per_rank: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all output is laid out by (source rank, local expert); return the indices that
    regroup it into one contiguous segment per local expert, and the segments' sizes."""
    start_index_values = torch.cumsum(tokens_per_expert_group, 0) - tokens_per_expert_group
    start_index_values = start_index_values.tolist()
    lengths = tokens_per_expert_group.tolist()
    permuted_indices = []
    for e in range(experts_per_rank):
        for r in range(num_ranks):
            i = r * experts_per_rank + e
            permuted_indices.append(
                torch.arange(start_index_values[i], start_index_values[i] + lengths[i])
            )
    m_sizes = tokens_per_expert_group.view(num_ranks, experts_per_rank).sum(dim=0)
    return torch.cat(permuted_indices), m_sizes


def _permute(x, num_tokens_per_expert_group, ep_degree, num_local_experts):
    with torch.no_grad():
        permuted_indices, num_tokens_per_expert = generate_permute_indices(
            num_tokens_per_expert_group, num_local_experts, ep_degree
        )
    input_shape = x.shape
    x = x[permuted_indices, :]
    return input_shape, x, permuted_indices, num_tokens_per_expert


def _unpermute(out, input_shape, permuted_indices):
    out_unpermuted = out.new_empty(input_shape)
    out_unpermuted[permuted_indices, :] = out
    return out_unpermuted


def all_to_all_single(input, output_split_sizes, input_split_sizes, group):
    input = input.contiguous()
    output = input.new_empty([sum(output_split_sizes)] + list(input.shape[1:]))
    dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)
    return output


class ExpertParallel:
    """Shards the stacked expert weights on dim 0 over the ep mesh; the experts module's input
    is dispatched to the experts' owners and its output is combined back (as
    distribute_module's input_fn / output_fn)."""

    def __init__(self):
        self.input_splits = None
        self.output_splits = None
        self.input_shape = None
        self.permuted_indices = None

    @staticmethod
    def _partition_fn(name, mod, device_mesh):
        ep_size, ep_rank = device_mesh.size(), device_mesh.get_local_rank()
        for param_name, param in mod.named_parameters(recurse=False):
            local_param = nn.Parameter(torch.chunk(param.detach(), ep_size, dim=0)[ep_rank].clone())
            mod.register_parameter(param_name, local_param)

    def _token_dispatch(self, mod, inputs, device_mesh):
        # annotate module input placements/sharding with input_layouts
        routed_input, num_tokens_per_expert = inputs
        ep_size = device_mesh.size()
        num_local_experts = num_tokens_per_expert.shape[0] // ep_size
        group = device_mesh.get_group()

        # generate the input splits and output splits for all-to-all
        with torch.no_grad():
            num_tokens_per_expert_group = torch.empty_like(num_tokens_per_expert)
            dist.all_to_all_single(num_tokens_per_expert_group, num_tokens_per_expert, group=group)
            input_splits = num_tokens_per_expert.view(ep_size, -1).sum(dim=1)
            output_splits = num_tokens_per_expert_group.view(ep_size, -1).sum(dim=1)
            self.input_splits = input_splits.tolist()
            self.output_splits = output_splits.tolist()

        # perform all-to-all
        routed_input = all_to_all_single(
            routed_input, self.output_splits, self.input_splits, group
        )

        # NOTE: After this all-to-all, the routed input is put on proper EP rank.
        # However, the num_tokens_per_expert_group is not of the final target format
        # [#tokens for local expert 0, #tokens for local expert 1, ...]
        # Rather, it is of the format
        # [#tokens for local expert 0 from EP rank 0, #tokens for local expert 1 from EP rank 0, ...,
        #  #tokens for local expert 0 from EP rank 1, #tokens for local expert 1 from EP rank 1, ...]
        # We need to perform another shuffle to get the correct layout, via the _permute function
        # below.
        (
            self.input_shape,
            routed_input,
            self.permuted_indices,
            num_tokens_per_expert_group,
        ) = _permute(routed_input, num_tokens_per_expert_group, ep_size, num_local_experts)

        return routed_input, num_tokens_per_expert_group

    def _token_combine(self, mod, routed_output, device_mesh):
        routed_output = _unpermute(routed_output, self.input_shape, self.permuted_indices)

        routed_output = all_to_all_single(
            routed_output, self.input_splits, self.output_splits, device_mesh.get_group()
        )
        return routed_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, submod in module.named_modules():
            self._partition_fn(name, submod, device_mesh)
        module.register_forward_pre_hook(
            lambda mod, inputs: self._token_dispatch(mod, inputs, device_mesh)
        )
        module.register_forward_hook(
            lambda mod, inputs, outputs: self._token_combine(mod, outputs, device_mesh)
        )
        return module


def apply_moe_ep(model: MoE, ep_mesh: DeviceMesh) -> None:
    ExpertParallel().apply(model.experts, ep_mesh)


class ReferenceMoE(nn.Module):
    """The same router and stacked experts on one device: every expert on every token, masked
    by the token's routing score for that expert."""

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = moe_args.num_experts
        self.experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=self.num_experts)
        self.router = TokenChoiceTopKRouter(dim=dim, num_experts=self.num_experts,
                                            top_k=moe_args.top_k, score_func=moe_args.score_func,
                                            route_norm=moe_args.route_norm,
                                            route_scale=moe_args.route_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, _ = self.router(x)
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            weight = (top_scores * (selected_experts_indices == e)).sum(dim=1, keepdim=True)
            expert_out = (F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
            out = out + weight * expert_out
        return out.reshape(bs, slen, dim)


def reference() -> nn.Module:
    return ReferenceMoE(MOE_ARGS, DIM, MOE_HIDDEN_DIM)


def rank_module(rank: int, world_size: int) -> nn.Module:
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model = MoE(MOE_ARGS, DIM, MOE_HIDDEN_DIM)
    apply_moe_ep(model, ep_mesh)
    return model


def inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 4, DIM)}


PARAM_PLACEMENTS = {
    "experts.w1": scalify.Shard(0),
    "experts.w2": scalify.Shard(0),
    "experts.w3": scalify.Shard(0),
}
INPUT_PLACEMENTS = {"x": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
