"""DeepSpeed AutoTP MLP block on 4 ranks (two tp groups of 2); BUG: LinearAllreduce reduces over
the whole world instead of its mp_group, summing the partial outputs of both tp groups."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "forward"
WORLD_SIZE = 4
BUG = "LinearAllreduce all-reduces over the default (world) group instead of its tensor-parallel mp_group, so the two tp groups' partial sums are added together."

HIDDEN, FFN, TP_SIZE = 16, 64, 2


class ReferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(HIDDEN, FFN), "c_proj": nn.Linear(FFN, HIDDEN)})

    def forward(self, hidden_states):
        h = self.mlp["c_fc"](self.ln_2(hidden_states))
        return hidden_states + self.mlp["c_proj"](F.gelu(h, approximate="tanh"))


# ---- deepspeed.module_inject.layers (imitation) ----
class LinearAllreduce(nn.Module):
    def __init__(self, weight, bias=None, mp_group=None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.mp_group = mp_group

    def forward(self, input):
        output = torch.matmul(input, self.weight.transpose(-1, -2))
        if self.mp_group is not None:
            dist.all_reduce(output)  # BUG
        if self.bias is not None:
            output += self.bias
        return output


class LinearLayer(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, input):
        output = torch.matmul(input, self.weight.transpose(-1, -2))
        if self.bias is not None:
            output += self.bias
        return output


def create_tp_groups(tp_size):
    """Like groups._create_model_parallel: consecutive ranks form a tensor-parallel group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, tp_size):
        group = dist.new_group(list(range(start, start + tp_size)))
        if rank in range(start, start + tp_size):
            mine = group
    return mine


class AutoTPBlock(nn.Module):
    """What AutoTP.replace_module leaves after slicing the block for mp_size=TP_SIZE."""

    def __init__(self, rank):
        super().__init__()
        self.mp_group = create_tp_groups(TP_SIZE)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        fc_w = nn.Parameter(torch.empty(FFN // TP_SIZE, HIDDEN))
        fc_b = nn.Parameter(torch.empty(FFN // TP_SIZE))
        proj_w = nn.Parameter(torch.empty(HIDDEN, FFN // TP_SIZE))
        proj_b = nn.Parameter(torch.empty(HIDDEN))
        self.mlp = nn.ModuleDict({"c_fc": LinearLayer(fc_w, fc_b),
                                  "c_proj": LinearAllreduce(proj_w, proj_b, self.mp_group)})

    def forward(self, hidden_states):
        h = self.mlp["c_fc"](self.ln_2(hidden_states))
        return hidden_states + self.mlp["c_proj"](F.gelu(h, approximate="tanh"))


def reference():
    return ReferenceBlock()


def rank_module(rank, world_size):
    return AutoTPBlock(rank)


def shard(state, rank, world_size):
    """ReplaceWithTensorSlicing: each rank keeps the slice of its rank inside its tp group."""
    mp_rank = rank % TP_SIZE
    out = {k: v.clone() for k, v in state.items() if k.startswith("ln_2")}
    out["mlp.c_fc.weight"] = state["mlp.c_fc.weight"].chunk(TP_SIZE, 0)[mp_rank].clone()
    out["mlp.c_fc.bias"] = state["mlp.c_fc.bias"].chunk(TP_SIZE, 0)[mp_rank].clone()
    out["mlp.c_proj.weight"] = state["mlp.c_proj.weight"].chunk(TP_SIZE, 1)[mp_rank].clone()
    out["mlp.c_proj.bias"] = state["mlp.c_proj.bias"].clone()
    return out


def inputs():
    return {"hidden_states": torch.randn(2, 5, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
