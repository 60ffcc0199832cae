"""DeepSpeed AutoTP inference on 4 ranks as 2 tensor-parallel groups of 2: groups are built like
groups._create_model_parallel (mp groups [0,1], [2,3] and data-parallel groups [0,2], [1,3], every
rank creating all of them with new_group); AutoTP.replace_module turns the MLP's fc_in into a
LinearLayer (column slice) and fc_out into a LinearAllreduce (row slice) whose forward
all-reduces on its mp_group in a call written over two lines, bias added after the reduction."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "forward"
WORLD_SIZE = 4
BUG = None

HIDDEN, FFN, MP_SIZE = 12, 32, 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(HIDDEN, FFN)
        self.fc_out = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, hidden_states):
        return hidden_states + self.mlp(self.ln(hidden_states))


# ---- deepspeed.utils.groups (imitation) ----
def _create_model_parallel(model_parallel_size):
    """Returns (data_parallel_group, model_parallel_group) of this rank."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dp_group = mp_group = None
    for i in range(model_parallel_size):
        ranks = list(range(i, world_size, model_parallel_size))
        group = dist.new_group(ranks)
        if i == (rank % model_parallel_size):
            dp_group = group
    for i in range(world_size // model_parallel_size):
        ranks = list(range(i * model_parallel_size, (i + 1) * model_parallel_size))
        group = dist.new_group(ranks)
        if i == (rank // model_parallel_size):
            mp_group = group
    return dp_group, mp_group


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
            dist.all_reduce(output,
                            group=self.mp_group)
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


# ---- deepspeed.module_inject.auto_tp (imitation) ----
class AutoTP:
    def __init__(self, mp_size, mp_group, all_reduce_linears):
        self.mp_size = mp_size
        self.mp_group = mp_group
        self.all_reduce_linears = all_reduce_linears

    def _replace(self, child, name):
        """Empty slices shaped like this rank's part; the checkpoint is loaded afterwards."""
        out_features, in_features = child.weight.shape
        if name in self.all_reduce_linears:
            weight = nn.Parameter(torch.empty(out_features, in_features // self.mp_size))
            bias = nn.Parameter(torch.empty(out_features)) if child.bias is not None else None
            return LinearAllreduce(weight, bias, self.mp_group)
        weight = nn.Parameter(torch.empty(out_features // self.mp_size, in_features))
        bias = nn.Parameter(torch.empty(out_features // self.mp_size)) if child.bias is not None else None
        return LinearLayer(weight, bias)

    def replace_module(self, module):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, self._replace(child, name))
            else:
                self.replace_module(child)
        return module


def reference():
    return Block()


def rank_module(rank, world_size):
    dp_group, mp_group = _create_model_parallel(MP_SIZE)
    policy = AutoTP(MP_SIZE, mp_group, all_reduce_linears=("fc_out",))
    return policy.replace_module(Block())


def shard(state, rank, world_size):
    """ReplaceWithTensorSlicing: the slice of this rank's position inside its mp group."""
    mp_rank = rank % MP_SIZE
    out = {k: v.clone() for k, v in state.items() if k.startswith("ln.")}
    out["mlp.fc_in.weight"] = state["mlp.fc_in.weight"].chunk(MP_SIZE, 0)[mp_rank].clone()
    out["mlp.fc_in.bias"] = state["mlp.fc_in.bias"].chunk(MP_SIZE, 0)[mp_rank].clone()
    out["mlp.fc_out.weight"] = state["mlp.fc_out.weight"].chunk(MP_SIZE, 1)[mp_rank].clone()
    out["mlp.fc_out.bias"] = state["mlp.fc_out.bias"].clone()
    return out


def inputs():
    return {"hidden_states": torch.randn(2, 3, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
