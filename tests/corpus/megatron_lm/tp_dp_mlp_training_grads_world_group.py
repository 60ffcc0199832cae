"""Megatron-LM (mpu) tp2 x dp2 training step -- BUG: allreduce_gradients reduces the coalesced
gradients over the whole world instead of the data-parallel group, so tensor-parallel replicas
are summed in as well."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
import scalify

STYLE = "megatron_lm"
STEP = "training"
WORLD_SIZE = 4
BUG = "The gradient all-reduce in allreduce_gradients runs over the default (world) group instead of the data-parallel group, adding the two tensor-parallel ranks' gradients together."

HIDDEN, FFN, SEQ, GLOBAL_BATCH, TP = 8, 16, 4, 4, 2

_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_):
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP
    world_size, rank, tp = dist.get_world_size(), dist.get_rank(), tensor_model_parallel_size_
    for i in range(tp):
        ranks = range(i, world_size, tp)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
    for i in range(world_size // tp):
        ranks = range(i * tp, (i + 1) * tp)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group
            _MODEL_PARALLEL_GROUP = group  # no pipeline parallelism


def get_data_parallel_world_size():
    return dist.get_world_size(group=_DATA_PARALLEL_GROUP)


def get_data_parallel_rank():
    return dist.get_rank(group=_DATA_PARALLEL_GROUP)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        dist.all_reduce(grad_output, group=_TENSOR_MODEL_PARALLEL_GROUP)
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=_TENSOR_MODEL_PARALLEL_GROUP)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class ParallelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        tp = dist.get_world_size(group=_TENSOR_MODEL_PARALLEL_GROUP)
        self.dense_h_to_4h = nn.Linear(HIDDEN, FFN // tp)            # ColumnParallelLinear
        self.dense_4h_to_h = nn.Linear(FFN // tp, HIDDEN)            # RowParallelLinear
        for p in (self.dense_h_to_4h.weight, self.dense_h_to_4h.bias, self.dense_4h_to_h.weight):
            p.tensor_model_parallel = True

    def forward(self, hidden_states):
        x = F.linear(_CopyToModelParallelRegion.apply(hidden_states), self.dense_h_to_4h.weight,
                     self.dense_h_to_4h.bias)
        x = F.gelu(x)
        out = _ReduceFromModelParallelRegion.apply(F.linear(x, self.dense_4h_to_h.weight))
        return out + self.dense_4h_to_h.bias


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(TP)
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = ParallelMLP()

    def allreduce_gradients(self, grads):
        coalesced = _flatten_dense_tensors(grads)
        coalesced /= get_data_parallel_world_size()
        dist.all_reduce(coalesced)  # BUG
        return list(_unflatten_dense_tensors(coalesced, grads))

    def forward(self, hidden_states, target):
        # the data loader hands each dp rank its slice of the global batch: [s, b, h]
        micro = GLOBAL_BATCH // get_data_parallel_world_size()
        start = get_data_parallel_rank() * micro
        hidden_states = hidden_states[:, start:start + micro]
        target = target[:, start:start + micro]
        output = self.mlp(self.input_layernorm(hidden_states))
        loss = F.mse_loss(output, target)
        params = list(self.parameters())
        grads = self.allreduce_gradients(list(torch.autograd.grad(loss, params)))
        # average_losses_across_data_parallel_group
        averaged_loss = torch.cat([loss.clone().detach().view(1)])
        dist.all_reduce(averaged_loss, group=_DATA_PARALLEL_GROUP)
        averaged_loss = averaged_loss / get_data_parallel_world_size()
        # clip_grad_norm: count tensor-parallel duplicates only once
        total_norm = torch.zeros(1, dtype=grads[0].dtype)
        for p, g in zip(params, grads):
            if getattr(p, "tensor_model_parallel", False) or dist.get_rank(group=_TENSOR_MODEL_PARALLEL_GROUP) == 0:
                total_norm += torch.norm(g) ** 2
        dist.all_reduce(total_norm, group=_MODEL_PARALLEL_GROUP)
        total_norm = total_norm ** 0.5
        ln_w, ln_b, _, _, _, fc2_b = grads
        return averaged_loss[0], total_norm[0], ln_w, ln_b, fc2_b


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(HIDDEN, FFN)
        self.mlp.dense_4h_to_h = nn.Linear(FFN, HIDDEN)

    def forward(self, hidden_states, target):
        x = self.input_layernorm(hidden_states)
        out = self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(x)))
        loss = F.mse_loss(out, target)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        total_norm = torch.sqrt(sum(torch.norm(g) ** 2 for g in grads))
        return loss, total_norm, grads[0], grads[1], grads[5]


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return Model()


def shard(state, rank, world_size):
    tp_rank = rank % TP
    out = {k: v.clone() for k, v in state.items()}
    for name, dim in (("mlp.dense_h_to_4h.weight", 0), ("mlp.dense_h_to_4h.bias", 0), ("mlp.dense_4h_to_h.weight", 1)):
        out[name] = torch.chunk(state[name], TP, dim)[tp_rank].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, GLOBAL_BATCH, HIDDEN),
            "target": torch.randn(SEQ, GLOBAL_BATCH, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
