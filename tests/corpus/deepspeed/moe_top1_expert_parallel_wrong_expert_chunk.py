"""DeepSpeed MoE with expert parallelism (top-1 gate, all_to_all dispatch/combine); BUG: the local
Experts module chunks its [ep_size, num_local_experts, C, M] input along the source-rank dim
instead of the local-expert dim, so tokens reach the wrong expert."""
import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "forward"
WORLD_SIZE = 2
BUG = "Experts.forward chunks the received tokens along dim 0 (source rank) instead of dim 1 (local expert), so each local expert processes another expert's tokens."

HIDDEN, FFN, NUM_EXPERTS = 8, 16, 4


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)


class ReferenceMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.experts = nn.ModuleList(Expert() for _ in range(NUM_EXPERTS))

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, HIDDEN)
        gates = F.softmax(self.gate.wg(tokens), dim=1)
        top1 = F.one_hot(gates.argmax(dim=1), NUM_EXPERTS).type_as(gates) * gates
        out = sum(top1[:, e:e + 1] * expert(tokens) for e, expert in enumerate(self.experts))
        return out.reshape(hidden_states.shape)


def top1gating(logits, capacity_factor, min_capacity):
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = max(min_capacity, math.ceil(num_tokens / num_experts * capacity_factor))
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    mask1 = mask1 * torch.lt(locations1, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.type_as(gates)
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).type_as(gates)
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    return combine_weights, combine_weights.bool()


class TopKGate(Gate):
    def __init__(self, capacity_factor, min_capacity=4):
        super().__init__()
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity

    def forward(self, input):
        return top1gating(self.wg(input), self.capacity_factor, self.min_capacity)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _AllToAll.apply(ctx.group, *grad_output))


class Experts(nn.Module):
    def __init__(self, num_local_experts):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(Expert() for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=0)  # BUG
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.deepspeed_experts)]
        return torch.cat(expert_outputs, dim=0)


class MOELayer(nn.Module):
    def __init__(self, gate, experts, ep_group, ep_size, num_local_experts):
        super().__init__()
        self.gate, self.experts, self.ep_group = gate, experts, ep_group
        self.ep_size, self.num_local_experts = ep_size, num_local_experts

    def forward(self, input):
        d_model = input.shape[-1]
        reshaped_input = input.reshape(-1, d_model)
        combine_weights, dispatch_mask = self.gate(reshaped_input)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(input), reshaped_input)
        dispatched_input = _AllToAll.apply(self.ep_group, dispatched_input)
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        expert_output = _AllToAll.apply(self.ep_group, expert_output)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights.type_as(input), expert_output)
        return combined_output.reshape(input.shape)


class MoE(nn.Module):
    def __init__(self, num_experts, ep_size):
        super().__init__()
        self.ep_group = dist.new_group(list(range(ep_size)))
        self.num_local_experts = num_experts // ep_size
        self.deepspeed_moe = MOELayer(TopKGate(capacity_factor=float(num_experts)),
                                      Experts(self.num_local_experts), self.ep_group,
                                      ep_size, self.num_local_experts)

    def forward(self, hidden_states):
        return self.deepspeed_moe(hidden_states)


def reference():
    return ReferenceMoE()


def rank_module(rank, world_size):
    return MoE(NUM_EXPERTS, ep_size=world_size)


def shard(state, rank, world_size):
    """Expert checkpoint layout: global expert rank * num_local + i is local expert i."""
    num_local = NUM_EXPERTS // world_size
    out = {"deepspeed_moe.gate.wg.weight": state["gate.wg.weight"].clone()}
    for i in range(num_local):
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            out[f"deepspeed_moe.experts.deepspeed_experts.{i}.{name}"] = \
                state[f"experts.{rank * num_local + i}.{name}"].clone()
    return out


def inputs():
    return {"hidden_states": torch.randn(2, 6, HIDDEN)}


INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Shard(0)]
