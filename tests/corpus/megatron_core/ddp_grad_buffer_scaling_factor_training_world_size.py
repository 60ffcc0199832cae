"""Megatron-Core training step on 4 ranks (TP=2 x DP=2): TP MLP on each DP rank's batch slice, MSE
loss, then a DistributedDataParallel whose ParamAndGradBuffer scales the flat grad buffer and
all-reduces it over the DP group, where the constructor computes gradient_scaling_factor from the
global world size (1/4) instead of the data-parallel size (1/2), so the averaged grads are halved."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "training"
WORLD_SIZE = 4
BUG = "The DDP constructor sets gradient_scaling_factor to 1 / world size (1/4) instead of 1 / data-parallel size (1/2), so the DP-all-reduced gradients are half the average."

HIDDEN, FFN, SEQ, BATCH, TP = 8, 16, 3, 4, 2
# the parameters every TP rank holds whole (their grads are returned, in this order)
REPLICATED = ("input_layernorm.weight", "input_layernorm.bias", "linear_fc2.bias")

_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None


def generate_rank_groups(tp, dp, token):
    """Ranks laid out on a [dp, tp] grid, tp varying fastest (order "tp-dp")."""
    grid = torch.arange(tp * dp).view(dp, tp)
    if token == "tp":
        return [grid[d, :].tolist() for d in range(dp)]
    return [grid[:, t].tolist() for t in range(tp)]     # "dp"


def initialize_model_parallel(tensor_model_parallel_size=1):
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    data_parallel_size = world_size // tensor_model_parallel_size
    for ranks in generate_rank_groups(tensor_model_parallel_size, data_parallel_size, "dp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
    for ranks in generate_rank_groups(tensor_model_parallel_size, data_parallel_size, "tp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_data_parallel_group():
    return _DATA_PARALLEL_GROUP


def get_data_parallel_world_size():
    return dist.get_world_size(group=get_data_parallel_group())


def _reduce(input_):
    dist.all_reduce(input_.contiguous(), group=get_tensor_model_parallel_group())
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


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=False):
        super().__init__()
        self.output_size_per_partition = output_size // get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))

    def forward(self, input_):
        input_parallel = _CopyToModelParallelRegion.apply(input_)
        return F.linear(input_parallel, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True):
        super().__init__()
        self.input_size_per_partition = input_size // get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(output_size))

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        output_ = _ReduceFromModelParallelRegion.apply(output_parallel)
        return output_ + self.bias, None


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN, gather_output=False)
        self.linear_fc2 = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)

    def forward(self, hidden_states):
        intermediate, _ = self.linear_fc1(self.input_layernorm(hidden_states))
        output, _ = self.linear_fc2(F.gelu(intermediate))
        return output


class ParamAndGradBuffer:
    def __init__(self, params, data_parallel_group, gradient_scaling_factor):
        self.data_parallel_group = data_parallel_group
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_index_map, offset = {}, 0
        for param in params[::-1]:           # backprop order: last layer first
            self.param_index_map[param] = (offset, offset + param.numel())
            offset += param.numel()
        self.grad_data = torch.zeros(offset, dtype=params[0].dtype)
        for param in params:
            start, end = self.param_index_map[param]
            param.main_grad = self.grad_data[start:end].view(param.shape)

    def start_grad_sync(self):
        self.grad_data *= self.gradient_scaling_factor
        dist.all_reduce(self.grad_data,
                        group=self.data_parallel_group)


class DistributedDataParallel(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        gradient_scaling_factor = 1.0 / dist.get_world_size()  # BUG
        self.buffer = ParamAndGradBuffer(list(module.parameters()), get_data_parallel_group(),
                                         gradient_scaling_factor=gradient_scaling_factor)

    def forward(self, *args):
        return self.module(*args)


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(tensor_model_parallel_size=TP)
        self.model = DistributedDataParallel(TransformerLayer())

    def forward(self, hidden_states, labels):
        micro = hidden_states.shape[1] // get_data_parallel_world_size()
        start = dist.get_rank(group=get_data_parallel_group()) * micro
        hidden_states, labels = hidden_states[:, start:start + micro], labels[:, start:start + micro]
        loss = F.mse_loss(self.model(hidden_states), labels)
        params = list(self.model.module.parameters())
        for param, grad in zip(params, torch.autograd.grad(loss, params)):
            param.main_grad.add_(grad)        # the backward hook accumulates into main_grad
        self.model.buffer.start_grad_sync()
        averaged_loss = loss.detach().clone()
        dist.all_reduce(averaged_loss, group=get_data_parallel_group())
        averaged_loss = averaged_loss / get_data_parallel_world_size()
        replicated = (p for n, p in self.model.module.named_parameters() if n in REPLICATED)
        return (averaged_loss, *(p.main_grad.clone() for p in replicated))


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.module = layer = nn.Module()
        layer.input_layernorm = nn.LayerNorm(HIDDEN)
        layer.linear_fc1, layer.linear_fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, hidden_states, labels):
        layer = self.model.module
        x = layer.input_layernorm(hidden_states)
        loss = F.mse_loss(layer.linear_fc2(F.gelu(layer.linear_fc1(x))), labels)
        params = [p for n, p in layer.named_parameters() if n in REPLICATED]
        return (loss, *torch.autograd.grad(loss, params))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return TrainStep()


TP_SHARD_DIMS = {"model.module.linear_fc1.weight": 0, "model.module.linear_fc1.bias": 0,
                 "model.module.linear_fc2.weight": 1}


def shard(state, rank, world_size):
    tp_rank = rank % TP           # the rank's TP coordinate on the [dp, tp] grid
    return {k: (torch.chunk(v, TP, TP_SHARD_DIMS[k])[tp_rank] if k in TP_SHARD_DIMS else v).clone()
            for k, v in state.items()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, BATCH, HIDDEN), "labels": torch.randn(SEQ, BATCH, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 4
