"""GShard/DeepSpeed-style top-1 MoE layer trained data parallel; the rank combines each expert's output with the wrong (rotated) one-hot mask column."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = "The rank weights expert e's output with one-hot mask column (e + 1) % NUM_EXPERTS instead of column e, so tokens are combined from the wrong experts."

HIDDEN = 16
FFN = 16
NUM_EXPERTS = 4
BATCH = 2
SEQ = 8


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TopKGate(nn.Module):
    """deepspeed.moe.sharded_moe.TopKGate with k=1: softmax gates and a one-hot expert mask."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, tokens):
        logits = self.wg(tokens)
        gates = F.softmax(logits, dim=-1)
        indices1_s = torch.argmax(gates, dim=-1)
        mask1 = F.one_hot(indices1_s, num_classes=NUM_EXPERTS).to(gates.dtype)
        return gates, mask1


class MOELayer(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int):
        super().__init__()
        self.gate = TopKGate(hidden, num_experts)
        self.experts = nn.ModuleList([Expert(hidden, ffn) for _ in range(num_experts)])

    def forward(self, x):
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        gates, mask1 = self.gate(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            combine_e = mask1[:, e] * gates[:, e]
            out = out + combine_e.unsqueeze(-1) * expert(tokens)
        return out.reshape(x.shape)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MOELayer(HIDDEN, FFN, NUM_EXPERTS)

    def forward(self, x, y):
        out = self.moe(x)
        loss = ((out - y) ** 2).sum()
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class DeepSpeedMOELayer(MOELayer):
    """The rank's MoE layer (ep_size=1: every rank holds all experts); dense dispatch/combine."""

    def forward(self, x):
        d_model = x.shape[-1]
        reshaped_input = x.reshape(-1, d_model)
        gates, mask1 = self.gate(reshaped_input)
        combined_output = torch.zeros_like(reshaped_input)
        for e, expert in enumerate(self.experts):
            combine_weights = mask1[:, (e + 1) % NUM_EXPERTS] * gates[:, e]  # BUG
            combined_output = combined_output + combine_weights.unsqueeze(-1) * expert(reshaped_input)
        return combined_output.reshape(x.shape)


class DataParallelModel(nn.Module):
    """A DeepSpeedEngine stand-in: local forward/backward on this rank's tokens, then
    allreduce_gradients (SUM, since the loss is a sum) and the summed loss for logging."""

    def __init__(self):
        super().__init__()
        self.moe = DeepSpeedMOELayer(HIDDEN, FFN, NUM_EXPERTS)

    def allreduce_gradients(self, grads):
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
        return grads

    def forward(self, x, y):
        out = self.moe(x)
        loss = ((out - y) ** 2).sum()
        grads = list(torch.autograd.grad(loss, list(self.parameters())))
        grads = self.allreduce_gradients(grads)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        return (loss, *grads)


def reference() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return DataParallelModel()


def inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"x": torch.randn(BATCH, SEQ, HIDDEN), "y": torch.randn(BATCH, SEQ, HIDDEN)}


PARAM_PLACEMENTS = {}  # everything replicated (pure data parallelism)
INPUT_PLACEMENTS = {"x": scalify.Shard(0), "y": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * (1 + 1 + NUM_EXPERTS * 4)
