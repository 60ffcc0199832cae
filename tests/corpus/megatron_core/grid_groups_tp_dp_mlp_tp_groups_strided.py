"""Megatron-Core parallel_state on 4 ranks (TP=2 x DP=2) with a ColumnParallelLinear -> gelu ->
RowParallelLinear MLP over DP slices of the batch, where the rank generator takes the TP groups along
the wrong grid axis ([0,2],[1,3], the DP axis) while the weights are still sharded by the TP coordinate
rank % 2, so each TP all-reduce sums two copies of the same shard."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "forward"
WORLD_SIZE = 4
BUG = "The rank generator builds the tensor-parallel groups along the data-parallel axis of the grid ([0,2],[1,3]) instead of [0,1],[2,3], so the TP all-reduce combines ranks holding the same weight shard."

HIDDEN, FFN, SEQ, BATCH, TP = 8, 16, 3, 4, 2

# parallel_state globals
_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_DATA_PARALLEL_GLOBAL_RANKS = None


class RankGenerator:
    """Ranks laid out on a [dp, tp] grid, tp varying fastest (order "tp-dp")."""

    def __init__(self, tp, dp):
        self.tp, self.dp = tp, dp
        self.world_size = tp * dp

    def get_ranks(self, token):
        grid = torch.arange(self.world_size).view(self.dp, self.tp)
        if token == "tp":
            return [grid[:, t].tolist() for t in range(self.tp)]  # BUG
        if token == "dp":
            return [grid[:, t].tolist() for t in range(self.tp)]
        raise ValueError(token)


def initialize_model_parallel(tensor_model_parallel_size=1):
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GLOBAL_RANKS
    world_size, rank = dist.get_world_size(), dist.get_rank()
    data_parallel_size = world_size // tensor_model_parallel_size
    rank_generator = RankGenerator(tp=tensor_model_parallel_size, dp=data_parallel_size)
    for ranks in rank_generator.get_ranks("dp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
            _DATA_PARALLEL_GLOBAL_RANKS = ranks
    for ranks in rank_generator.get_ranks("tp"):
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_data_parallel_group():
    return _DATA_PARALLEL_GROUP


def get_data_parallel_rank():
    return dist.get_rank(group=get_data_parallel_group())


def get_data_parallel_world_size():
    return dist.get_world_size(group=get_data_parallel_group())


def _reduce(input_):
    if get_tensor_model_parallel_world_size() == 1:
        return input_
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
        assert not gather_output
        self.output_size_per_partition = output_size // get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None

    def forward(self, input_):
        input_parallel = _CopyToModelParallelRegion.apply(input_)
        return F.linear(input_parallel, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True):
        super().__init__()
        assert input_is_parallel
        self.input_size_per_partition = input_size // get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, input_parallel):
        output_parallel = F.linear(input_parallel, self.weight)
        output_ = _ReduceFromModelParallelRegion.apply(output_parallel)
        return output_ + self.bias, None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN, gather_output=False)
        self.linear_fc2 = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)

    def forward(self, hidden_states):
        intermediate, _ = self.linear_fc1(hidden_states)
        output, _ = self.linear_fc2(F.gelu(intermediate))
        return output


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(tensor_model_parallel_size=TP)
        self.mlp = MLP()

    def forward(self, hidden_states):
        # [s, b, h]: this data-parallel rank's micro-batch
        micro = hidden_states.shape[1] // get_data_parallel_world_size()
        start = get_data_parallel_rank() * micro
        output = self.mlp(hidden_states[:, start:start + micro])
        gathered = [torch.empty_like(output) for _ in range(get_data_parallel_world_size())]
        dist.all_gather(gathered, output.contiguous(), group=get_data_parallel_group())
        return torch.cat(gathered, dim=1)


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(HIDDEN, FFN)
        self.mlp.linear_fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, hidden_states):
        return self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(hidden_states)))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return Model()


TP_SHARD_DIMS = {"mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0, "mlp.linear_fc2.weight": 1}


def shard(state, rank, world_size):
    tp_rank = rank % TP           # the rank's TP coordinate on the [dp, tp] grid
    return {k: (torch.chunk(v, TP, TP_SHARD_DIMS[k])[tp_rank] if k in TP_SHARD_DIMS else v).clone()
            for k, v in state.items()}


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, BATCH, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
