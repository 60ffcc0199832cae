"""Megatron-LM (mpu) ParallelMLP on [s, b, h] -- BUG: RowParallelLinear adds its bias inside
F.linear on every rank before the tensor-parallel all-reduce, so the bias is summed once per rank."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "forward"
WORLD_SIZE = 2
BUG = 'RowParallelLinear adds the output bias inside F.linear on every rank before the tensor-parallel all-reduce, so the bias is counted once per rank (plus the skip_bias_add bias).'

HIDDEN, FFN = 16, 32

# ---------------------------------------------------------------- mpu/initialize.py
_TENSOR_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_=1):
    global _TENSOR_MODEL_PARALLEL_GROUP
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    for i in range(world_size // tensor_model_parallel_size_):
        ranks = range(i * tensor_model_parallel_size_, (i + 1) * tensor_model_parallel_size_)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    assert _TENSOR_MODEL_PARALLEL_GROUP is not None, "intra_layer_model parallel group is not initialized"
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=get_tensor_model_parallel_group())


# ---------------------------------------------------------------- mpu/mappings.py
def _reduce(input_):
    """All-reduce the input tensor across model parallel group."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_, group=get_tensor_model_parallel_group())
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_tensor_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


# ---------------------------------------------------------------- mpu/layers.py
class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True, skip_bias_add=False):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = output_size // world_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None
        nn.init.xavier_normal_(self.weight)

    def forward(self, input_):
        bias = self.bias if not self.skip_bias_add else None
        input_parallel = copy_to_tensor_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight, bias)
        assert not self.gather_output
        output_bias = self.bias if self.skip_bias_add else None
        return output_parallel, output_bias


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, skip_bias_add=False):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size // world_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        nn.init.xavier_normal_(self.weight)

    def forward(self, input_):
        assert self.input_is_parallel
        input_parallel = input_
        output_parallel = F.linear(input_parallel, self.weight, self.bias)  # BUG
        output_ = reduce_from_tensor_model_parallel_region(output_parallel)
        if not self.skip_bias_add:
            output = output_ + self.bias if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias


def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class ParallelMLP(nn.Module):
    def __init__(self, hidden_size=HIDDEN, ffn_hidden_size=FFN):
        super().__init__()
        initialize_model_parallel(dist.get_world_size())
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, ffn_hidden_size, gather_output=False,
                                                  skip_bias_add=True)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size, input_is_parallel=True,
                                               skip_bias_add=True)

    def forward(self, hidden_states):
        # hidden_states: [s, b, h]
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = bias_gelu(bias_parallel, intermediate_parallel)
        output, output_bias = self.dense_4h_to_h(intermediate_parallel)
        return output + output_bias


class ReferenceMLP(nn.Module):
    def __init__(self, hidden_size=HIDDEN, ffn_hidden_size=FFN):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, hidden_states):
        x = self.dense_h_to_4h(hidden_states)
        x = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
        return self.dense_4h_to_h(x)


def reference() -> nn.Module:
    return ReferenceMLP()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return ParallelMLP()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(6, 2, HIDDEN)}


PARAM_PLACEMENTS = {"dense_h_to_4h.weight": scalify.Shard(0), "dense_h_to_4h.bias": scalify.Shard(0),
                    "dense_4h_to_h.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
