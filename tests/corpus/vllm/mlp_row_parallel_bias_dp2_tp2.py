"""vLLM gate/up MLP on a 2-D layout of 4 ranks, data parallel 2 x tensor parallel 2:
initialize_model_parallel(tp=2, dp=2) builds the TP groups [0,1], [2,3] and the DP groups
[0,2], [1,3] with new_group (vLLM's `all_ranks` grid, every rank creating every group in the same
order); MergedColumnParallelLinear (fused gate_up, gather_output=False) -> SiluAndMul ->
RowParallelLinear (input_is_parallel=True, reduce_results=True, bias added on tp rank 0 only,
then tensor_model_parallel_all_reduce on the TP group), on flattened [num_tokens, hidden] tokens.

Input layout: a case's INPUT_PLACEMENTS are 1-D over all 4 ranks (rank r gets chunk r of
torch.chunk(t, 4, dim)), so a batch split over the dp dimension alone (ranks 0,1 one half, ranks
2,3 the other) cannot be stated: Shard(0) would hand the two tp ranks of one group different
tokens. The input is therefore Replicate and each dp replica (like a vLLM DP engine) runs the
whole batch; the dp dimension shows only in the rank grid and in which ranks the TP all-reduce
spans. The shard converter gives rank r the tp shard r % 2 (its coordinate on the tp axis)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 4
BUG = None

HIDDEN, INTERMEDIATE, NUM_TOKENS = 12, 24, 5
TP_SIZE, DP_SIZE, PP_SIZE = 2, 2, 1


# ---- vllm.distributed.parallel_state (imitation) ----
class GroupCoordinator:
    """One process group per list in `group_ranks`; this rank keeps the one it belongs to."""

    def __init__(self, group_ranks, group_name):
        self.unique_name = group_name
        self.rank = dist.get_rank()
        self.device_group = None
        for ranks in group_ranks:
            device_group = dist.new_group(ranks)
            if self.rank in ranks:
                self.ranks = ranks
                self.world_size = len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                self.device_group = device_group
        assert self.device_group is not None

    def all_reduce(self, input_):
        if self.world_size == 1:
            return input_
        dist.all_reduce(input_, group=self.device_group)
        return input_


_TP = None
_DP = None


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              data_parallel_size=1):
    global _TP, _DP
    world_size = dist.get_world_size()
    assert world_size == (tensor_model_parallel_size * pipeline_model_parallel_size
                          * data_parallel_size)
    all_ranks = torch.arange(world_size).reshape(
        -1, data_parallel_size, pipeline_model_parallel_size, tensor_model_parallel_size)
    # Build the tensor model-parallel groups.
    group_ranks = all_ranks.view(-1, tensor_model_parallel_size).unbind(0)
    group_ranks = [x.tolist() for x in group_ranks]
    _TP = GroupCoordinator(group_ranks, group_name="tp")
    # Build the data parallel groups.
    group_ranks = all_ranks.transpose(1, 3).reshape(-1, data_parallel_size).unbind(0)
    group_ranks = [x.tolist() for x in group_ranks]
    _DP = GroupCoordinator(group_ranks, group_name="dp")


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(input_)


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


# ---- vllm.model_executor.layers.linear (imitation) ----
class UnquantizedLinearMethod:
    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    def __init__(self, input_size, output_size, skip_bias_add=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.quant_method = UnquantizedLinearMethod()


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, gather_output=False,
                 skip_bias_add=False):
        super().__init__(input_size, output_size, skip_bias_add)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition)) if bias else None

    def forward(self, input_):
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = self.quant_method.apply(self, input_, bias)
        assert not self.gather_output, "this model keeps the column-parallel output sharded"
        output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one weight: rank r holds [gate_r; up_r]."""

    def __init__(self, input_size, output_sizes, bias=True, gather_output=False,
                 skip_bias_add=False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True,
                 skip_bias_add=False, reduce_results=True):
        super().__init__(input_size, output_size, skip_bias_add)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = input_.tensor_split(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        # Only fuse bias add into GEMM for rank 0 (this ensures that
        # bias will not get added more than once in TP>1 case)
        bias_ = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output_parallel = self.quant_method.apply(self, input_parallel, bias=bias_)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output_parallel)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


# ---- vllm.model_executor.layers.activation (imitation) ----
class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


# ---- the model ----
class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=False, gather_output=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=True,
                                           input_is_parallel=True, reduce_results=True)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        x = self.act_fn(gate_up)
        x, _ = self.down_proj(x)
        return x


class ReferenceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=True)

    def forward(self, hidden_states):
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class RankMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP(HIDDEN, INTERMEDIATE)

    def forward(self, hidden_states):
        return self.mlp(hidden_states)


def reference() -> nn.Module:
    return ReferenceMLP()


def rank_module(rank: int, world_size: int) -> nn.Module:
    initialize_model_parallel(tensor_model_parallel_size=TP_SIZE,
                              pipeline_model_parallel_size=PP_SIZE, data_parallel_size=DP_SIZE)
    return RankMLP()


def shard(state, rank, world_size):
    """Rank r sits at (dp, tp) = (r // 2, r % 2) of the grid and holds tp shard r % 2 (what the
    weight_loaders load for tp_rank r % 2): gate_proj and up_proj row shards fused into
    gate_up_proj (loaded_shard_id 0 and 1), down_proj split along its input dim, its bias whole."""
    tp_rank = rank % TP_SIZE
    gate = state["gate_proj.weight"].chunk(TP_SIZE, 0)[tp_rank]
    up = state["up_proj.weight"].chunk(TP_SIZE, 0)[tp_rank]
    return {"mlp.gate_up_proj.weight": torch.cat([gate, up], 0).clone(),
            "mlp.down_proj.weight": state["down_proj.weight"].chunk(TP_SIZE, 1)[tp_rank].clone(),
            "mlp.down_proj.bias": state["down_proj.bias"].clone()}


def inputs():
    return {"hidden_states": torch.randn(NUM_TOKENS, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
