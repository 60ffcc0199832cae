"""Megatron-LM MoELayer with expert parallelism (EP=2, 4 experts, top-2) and the all-gather token
dispatcher: a replicated TopKRouter (top-2 of the logits, softmax over them, i.e. the top-2
probabilities renormalized) returns dense probs and a boolean routing map;
MoEAllGatherTokenDispatcher all-gathers the hidden states, probs and routing map over the
tensor-and-expert parallel group, keeps its local experts' columns and permutes the tokens routed
to them with the boolean map; SequentialMLP runs each local SwiGLU expert (fused
linear_fc1 = [gate; up]) on its segment; the unpermute weights the outputs by the probs and
index_adds them into a buffer of all the gathered tokens, which is reduce-scattered back so every
rank gets its own tokens. The reference is an HF-Mixtral-style sparse MoE block on one device.
Tokens ([s, b, h]) are sharded on the sequence."""
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "megatron_lm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None


@dataclass
class TransformerConfig:
    hidden_size: int = 16
    moe_ffn_hidden_size: int = 16
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    add_bias_linear: bool = False
    init_method_std: float = 0.3
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 2


CONFIG = TransformerConfig()


# --------------------------------------------------------------------------------------------
# parallel_state
# --------------------------------------------------------------------------------------------

_TENSOR_MODEL_PARALLEL_GROUP = None
_EXPERT_MODEL_PARALLEL_GROUP = None
_TENSOR_AND_EXPERT_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1) -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_GROUP
    global _TENSOR_AND_EXPERT_PARALLEL_GROUP
    world_size = dist.get_world_size()
    rank = dist.get_rank()

    num_tensor_model_parallel_groups = world_size // tensor_model_parallel_size
    for i in range(num_tensor_model_parallel_groups):
        ranks = list(range(i * tensor_model_parallel_size, (i + 1) * tensor_model_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group

    tensor_and_expert_group_size = tensor_model_parallel_size * expert_model_parallel_size
    for i in range(world_size // tensor_and_expert_group_size):
        start_rank = i * tensor_and_expert_group_size
        end_rank = (i + 1) * tensor_and_expert_group_size
        ranks = list(range(start_rank, end_rank))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_AND_EXPERT_PARALLEL_GROUP = group
        for j in range(tensor_model_parallel_size):
            ranks = list(range(start_rank + j, end_rank, tensor_model_parallel_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                _EXPERT_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_expert_model_parallel_group():
    return _EXPERT_MODEL_PARALLEL_GROUP


def get_expert_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_expert_model_parallel_group())


def get_expert_model_parallel_rank() -> int:
    return dist.get_rank(group=get_expert_model_parallel_group())


def get_tensor_and_expert_parallel_group():
    return _TENSOR_AND_EXPERT_PARALLEL_GROUP


# --------------------------------------------------------------------------------------------
# tensor_parallel mappings
# --------------------------------------------------------------------------------------------


def _gather_along_first_dim(input_, group):
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_first_dim(input_, group):
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    assert dim_size[0] % world_size == 0, \
        "First dimension of the tensor should be divisible by tensor parallel size"
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
    return output


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Gather the input from the sequence parallel region and concatenate."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_first_dim(grad_output, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce scatter the input from the model parallel region."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


def gather_from_sequence_parallel_region(input_, group):
    return _GatherFromSequenceParallelRegion.apply(input_, group)


def reduce_scatter_to_sequence_parallel_region(input_, group):
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


# --------------------------------------------------------------------------------------------
# moe_utils
# --------------------------------------------------------------------------------------------


def topk_softmax_with_capacity(logits: torch.Tensor, topk: int):
    """Top-k routing without token dropping: the softmax over the top-k logits (the top-k
    probabilities, renormalized), scattered into dense [num_tokens, num_experts] probs, and the
    boolean routing map of the chosen experts."""
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(scores, dim=-1)
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_indices, probs)
    topk_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return topk_masked_gates, topk_map


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """Copy the tokens routed to each expert into one contiguous segment per expert.

    Args:
        tokens: [num_tokens, hidden]
        routing_map: [num_tokens, num_experts], True where a token is routed to an expert.
    """
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    # mask [num_tokens, num_experts] -> [num_experts, num_tokens]
    routing_map = routing_map.bool().T.contiguous()
    # create a dense expert-to-token mapping from the sparse token-to-expert mapping
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(
        num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    # use the mapping to permute the tokens
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
              restore_shape: torch.Size, probs: torch.Tensor, routing_map: torch.Tensor):
    """Weight the permuted expert outputs by their routing probs and sum them back per token."""
    _, hidden = restore_shape
    # [num_tokens, num_experts] -> [num_experts, num_tokens], then the probs of the routed slots
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, device=permuted_tokens.device,
                                dtype=permuted_tokens.dtype)
    output_tokens.index_add_(0, sorted_indices, permuted_tokens)
    return output_tokens


# --------------------------------------------------------------------------------------------
# router, experts, token dispatcher, MoE layer
# --------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)

    def routing(self, logits: torch.Tensor):
        logits = logits.view(-1, self.config.num_moe_experts)
        return topk_softmax_with_capacity(logits, self.topk)

    def forward(self, input: torch.Tensor):
        logits = self.gating(input)
        probs, routing_map = self.routing(logits)
        return probs, routing_map


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        ffn_hidden_size = config.moe_ffn_hidden_size
        if config.gated_linear_unit:
            ffn_hidden_size *= 2
        self.linear_fc1 = nn.Linear(config.hidden_size, ffn_hidden_size,
                                    bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(config.moe_ffn_hidden_size, config.hidden_size,
                                    bias=config.add_bias_linear)

        if config.gated_linear_unit:
            def glu(x):
                x = torch.chunk(x, 2, dim=-1)
                return config.activation_func(x[0]) * x[1]

            self.activation_func = glu
        else:
            self.activation_func = config.activation_func

    def forward(self, hidden_states: torch.Tensor):
        intermediate_parallel = self.linear_fc1(hidden_states)
        intermediate_parallel = self.activation_func(intermediate_parallel)
        output = self.linear_fc2(intermediate_parallel)
        return output, None


class SequentialMLP(nn.Module):
    """The local experts, each run on its contiguous segment of the permuted tokens."""

    def __init__(self, num_local_experts: int, config: TransformerConfig):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList([MLP(config) for _ in range(num_local_experts)])

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        output_local_list = []
        for expert, tokens in zip(self.local_experts, tokens_list):
            output, _ = expert(tokens)
            output_local_list.append(output)
        output_local = torch.cat(output_local_list, dim=0)
        return output_local, None


class MoEAllGatherTokenDispatcher:
    """AllGather based token dispatcher: every rank sees all the tokens of the tensor-and-expert
    parallel group and keeps those routed to its local experts."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int],
                 config: TransformerConfig):
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        assert len(self.local_expert_indices) > 0, "Expected at least one expert"
        self.router_topk = config.moe_router_topk
        self.tp_size = config.tensor_model_parallel_size
        self.ep_size = config.expert_model_parallel_size
        self.tp_ep_group = get_tensor_and_expert_parallel_group()

        # [global_num_tokens, num_local_experts]
        self.local_map = None
        self.local_probs = None
        self.reversed_local_input_permutation_mapping = None
        self.hidden_shape = None
        self.hidden_shape_before_permute = None

    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                          routing_map: torch.Tensor):
        """Dispatch tokens to local experts.

        Args:
            hidden_states: [S/TP, B, H]
            probs: [S*B/TP, num_experts]
            routing_map: [S*B/TP, num_experts], True for the chosen experts.

        Returns:
            the permuted tokens of the local experts and the number of tokens per local expert.
        """
        self.hidden_shape = hidden_states.shape
        # [S/TP, B, H] -> [S*B/TP, H]
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])

        # Permute the tokens across the expert parallel devices.
        if self.tp_size > 1 or self.ep_size > 1:
            with torch.no_grad():
                # [num_local_tokens, num_experts] -> [num_global_tokens, num_experts], where:
                #     num_local_tokens=(S/TP)*B, num_global_tokens=S*B*EP
                routing_map = gather_from_sequence_parallel_region(routing_map, self.tp_ep_group)

            # max_prob: [S/TP*B, num_experts] -> global_probs: [S*B*EP, num_experts]
            probs = gather_from_sequence_parallel_region(probs, self.tp_ep_group)

            # Note that this allgather spans the communication domain of TP*EP.
            #  [(S/TP)*B, H] -> [((S/TP)*B)*(TP*EP), H] = [S*B*EP, H]
            hidden_states = gather_from_sequence_parallel_region(hidden_states, self.tp_ep_group)

        self.hidden_shape_before_permute = hidden_states.shape

        # The routing map and probs that for local experts.
        self.local_map = routing_map[
            :, self.local_expert_indices[0]: self.local_expert_indices[-1] + 1
        ].contiguous()
        self.local_probs = probs[
            :, self.local_expert_indices[0]: self.local_expert_indices[-1] + 1
        ].contiguous()

        tokens_per_expert = self.local_map.sum(dim=0).long()

        (permuted_local_hidden_states, self.reversed_local_input_permutation_mapping) = permute(
            hidden_states, self.local_map
        )
        return permuted_local_hidden_states, tokens_per_expert

    def token_unpermutation(self, hidden_states: torch.Tensor, bias: torch.Tensor = None):
        """Reverse process of `token_permutation`: combine the expert outputs of all the gathered
        tokens and reduce-scatter them back to the ranks that own the tokens."""
        assert bias is None, "Bias is not supported in MoEAllGatherTokenDispatcher"
        # Unpermute the expert output and weight it by the routing probs
        unpermuted_local_hidden = unpermute(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            probs=self.local_probs,
            routing_map=self.local_map,
        )

        output_total = unpermuted_local_hidden
        # Unpermute the tokens across ranks.
        if self.tp_size > 1 or self.ep_size > 1:
            output_total = reduce_scatter_to_sequence_parallel_region(
                output_total, self.tp_ep_group
            )

        output_total = output_total.view(self.hidden_shape)
        return output_total, None


class MoELayer(nn.Module):
    """Mixture of experts layer: router, all-gather token dispatcher, local experts."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.expert_parallel_size = get_expert_model_parallel_world_size()
        assert config.num_moe_experts % self.expert_parallel_size == 0
        self.num_local_experts = config.num_moe_experts // self.expert_parallel_size
        local_expert_indices_offset = get_expert_model_parallel_rank() * self.num_local_experts
        self.local_expert_indices = [
            local_expert_indices_offset + i for i in range(self.num_local_experts)
        ]
        assert all(map(lambda x: x < config.num_moe_experts, self.local_expert_indices))

        self.router = TopKRouter(config=config)
        self.experts = SequentialMLP(self.num_local_experts, config)
        self.token_dispatcher = MoEAllGatherTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # process MoE
        probs, routing_map = self.router(hidden_states)
        (dispatched_input, tokens_per_expert) = self.token_dispatcher.token_permutation(
            hidden_states, probs, routing_map
        )
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert)
        output, mlp_bias = self.token_dispatcher.token_unpermutation(expert_output, mlp_bias)
        return output


# --------------------------------------------------------------------------------------------
# single-device reference: a Mixtral sparse MoE block
# --------------------------------------------------------------------------------------------


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.ffn_dim = config.moe_ffn_hidden_size
        self.hidden_dim = config.hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current_hidden_states = self.w2(current_hidden_states)
        return current_hidden_states


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.ffn_dim = config.moe_ffn_hidden_size
        self.num_experts = config.num_moe_experts
        self.top_k = config.moe_router_topk

        # gating
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [MixtralBlockSparseTop2MLP(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        sequence_length, batch_size, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        # router_logits: (batch * sequence_length, n_experts)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)

        final_hidden_states = torch.zeros(
            (sequence_length * batch_size, hidden_dim), dtype=hidden_states.dtype,
            device=hidden_states.device
        )

        # One hot encode the selected experts to create an expert mask
        # this will be used to easily index which expert is going to be sollicitated
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

        # Loop over all available experts in the model and perform the computation on each expert
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])

            # Index the correct hidden states and compute the expert hidden state for
            # the current expert. We need to make sure to multiply the output hidden
            # states by `routing_weights` on the corresponding tokens (top-1 and top-2)
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]

            # However `index_add_` only support torch tensors for indexing so we'll use
            # the `top_x` tensor here.
            final_hidden_states.index_add_(0, top_x, current_hidden_states)
        return final_hidden_states.reshape(sequence_length, batch_size, hidden_dim)


def reference() -> nn.Module:
    return MixtralSparseMoeBlock(CONFIG)


def rank_module(rank: int, world_size: int) -> nn.Module:
    initialize_model_parallel(
        tensor_model_parallel_size=CONFIG.tensor_model_parallel_size,
        expert_model_parallel_size=CONFIG.expert_model_parallel_size,
    )
    return MoELayer(CONFIG)


def shard(state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """HF Mixtral checkpoint -> Megatron MoE checkpoint of expert-parallel rank `rank`: the gate
    becomes the router, and global expert `rank * num_local + i` becomes local expert i with
    linear_fc1 = [w1; w3] (gate and up fused) and linear_fc2 = w2."""
    num_local_experts = CONFIG.num_moe_experts // CONFIG.expert_model_parallel_size
    ep_rank = rank // CONFIG.tensor_model_parallel_size % CONFIG.expert_model_parallel_size
    out = {"router.weight": state["gate.weight"].clone()}
    for i in range(num_local_experts):
        e = ep_rank * num_local_experts + i
        out[f"experts.local_experts.{i}.linear_fc1.weight"] = torch.cat(
            [state[f"experts.{e}.w1.weight"], state[f"experts.{e}.w3.weight"]], dim=0)
        out[f"experts.local_experts.{i}.linear_fc2.weight"] = state[f"experts.{e}.w2.weight"].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(8, 2, CONFIG.hidden_size)}   # [s, b, h]


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
