"""vLLM MixtralMoE at tp=2 (FusedMoE with tp-sharded stacked expert weights); BUG: FusedMoE is
built with reduce_results=True while the MoE block also all-reduces, so the output is reduced twice."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = "FusedMoE is constructed with reduce_results=True and MixtralMoE all-reduces its output again, summing the already-reduced result tp_size times."

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 16, 24, 4, 2


def get_tensor_model_parallel_world_size():
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(x):
    dist.all_reduce(x)
    return x


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReferenceMoE(nn.Module):
    """HF-style Mixtral sparse MoE block (the checkpoint layout)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = nn.ModuleList(MixtralBlockSparseTop2MLP() for _ in range(NUM_EXPERTS))

    def forward(self, hidden_states):
        x = hidden_states.view(-1, HIDDEN)
        routing_weights = F.softmax(self.gate(x), dim=1)
        routing_weights, selected = torch.topk(routing_weights, TOP_K, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            weight = (routing_weights * (selected == e)).sum(dim=-1, keepdim=True)
            out = out + weight * expert(x)
        return out.view(hidden_states.shape)


def torch_moe(a, w13, w2, score, topk, renormalize=True):
    b, h = a.shape
    a = a.view(b, 1, h).repeat(1, topk, 1).reshape(-1, h)
    out = torch.zeros(b * topk, w2.shape[1], dtype=a.dtype, device=a.device)
    score = torch.softmax(score, dim=-1)
    topk_weight, topk_ids = torch.topk(score, topk)
    if renormalize:
        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
    topk_weight, topk_ids = topk_weight.view(-1), topk_ids.view(-1)
    for i in range(w13.shape[0]):
        mask = topk_ids == i
        if mask.sum():
            gate_up = torch.einsum("th,oh->to", a[mask], w13[i])
            d = gate_up.shape[-1] // 2
            out[mask] = torch.einsum("ti,hi->th", F.silu(gate_up[:, :d]) * gate_up[:, d:], w2[i])
    return (out.view(b, -1, w2.shape[1]) * topk_weight.view(b, -1, 1)).sum(dim=1)


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))

    def forward(self, x):
        return F.linear(x, self.weight), None


class FusedMoE(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, reduce_results=False, renormalize=True):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.top_k, self.reduce_results, self.renormalize = top_k, reduce_results, renormalize
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size_per_partition, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size_per_partition))

    def forward(self, hidden_states, router_logits):
        final_hidden_states = torch_moe(hidden_states, self.w13_weight, self.w2_weight, router_logits,
                                        self.top_k, self.renormalize)
        if self.reduce_results and self.tp_size > 1:
            final_hidden_states = tensor_model_parallel_all_reduce(final_hidden_states)
        return final_hidden_states


class MixtralMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = ReplicatedLinear(HIDDEN, NUM_EXPERTS)
        self.experts = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, reduce_results=True, renormalize=True)  # BUG

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, HIDDEN)
        router_logits, _ = self.gate(hidden_states)
        final_hidden_states = self.experts(hidden_states, router_logits)
        if get_tensor_model_parallel_world_size() > 1:
            final_hidden_states = tensor_model_parallel_all_reduce(final_hidden_states)
        return final_hidden_states.view(orig_shape)


def reference():
    return ReferenceMoE()


def rank_module(rank, world_size):
    return MixtralMoE()


def shard(state, rank, world_size):
    """FusedMoE.weight_loader: per expert, w1 -> shard_id 'w1', w3 -> 'w3' of w13 (this rank's
    rows of each), w2 -> this rank's columns."""
    w13, w2 = [], []
    for e in range(NUM_EXPERTS):
        w1 = state[f"experts.{e}.w1.weight"].chunk(world_size, 0)[rank]
        w3 = state[f"experts.{e}.w3.weight"].chunk(world_size, 0)[rank]
        w13.append(torch.cat([w1, w3], 0))
        w2.append(state[f"experts.{e}.w2.weight"].chunk(world_size, 1)[rank])
    return {"gate.weight": state["gate.weight"].clone(),
            "experts.w13_weight": torch.stack(w13).clone(), "experts.w2_weight": torch.stack(w2).clone()}


def inputs():
    return {"hidden_states": torch.randn(2, 5, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
