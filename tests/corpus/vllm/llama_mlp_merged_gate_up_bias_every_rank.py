"""vLLM LlamaMLP (fused gate_up + RowParallelLinear); BUG: the RowParallelLinear bias is added on
every tp rank before the all-reduce, so it is counted tp_size times."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = "RowParallelLinear adds its bias on every tensor-parallel rank before the all-reduce, so the bias is summed tp_size times."

HIDDEN, INTERMEDIATE = 16, 32


# ---- vllm.distributed.parallel_state (imitation) ----
def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank()


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_)
    return input_


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


class MergedColumnParallelLinear(LinearBase):
    def __init__(self, input_size, output_sizes, bias=False, gather_output=False):
        super().__init__(input_size, sum(output_sizes))
        self.output_sizes = output_sizes
        self.output_size_per_partition = divide(sum(output_sizes), self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition)) if bias else None
        self.gather_output = gather_output

    def forward(self, input_):
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = self.quant_method.apply(self, input_, bias)
        output_bias = self.bias if self.skip_bias_add else None
        return output_parallel, output_bias


class RowParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True,
                 reduce_results=True, skip_bias_add=False):
        super().__init__(input_size, output_size, skip_bias_add)
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = input_.tensor_split(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias_ = None if self.skip_bias_add else self.bias  # BUG
        output_parallel = self.quant_method.apply(self, input_parallel, bias=bias_)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output_parallel)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=True)
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
        self.mlp = LlamaMLP(HIDDEN, INTERMEDIATE)

    def forward(self, hidden_states):
        return self.mlp(hidden_states)


def reference() -> nn.Module:
    return ReferenceMLP()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return RankMLP()


def shard(state, rank, world_size):
    """The checkpoint's gate_proj/up_proj go into the fused gate_up_proj (the weight_loader's
    loaded_shard_id 0 and 1); down_proj is split along its input dim."""
    gate = state["gate_proj.weight"].chunk(world_size, 0)[rank]
    up = state["up_proj.weight"].chunk(world_size, 0)[rank]
    return {"mlp.gate_up_proj.weight": torch.cat([gate, up], 0).clone(),
            "mlp.down_proj.weight": state["down_proj.weight"].chunk(world_size, 1)[rank].clone(),
            "mlp.down_proj.bias": state["down_proj.bias"].clone()}


def inputs():
    return {"hidden_states": torch.randn(6, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
