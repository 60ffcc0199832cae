"""nanotron training step on a tp=2 x dp=2 ParallelContext (groups from dist.new_group): RMSNorm,
a TensorParallelColumnLinear up_proj, silu, a TensorParallelRowLinear down_proj in ALL_REDUCE
mode; each dp rank takes its micro-batch, its gradients are flattened into one contiguous bucket,
pre-divided, all-reduced over dp_pg in place and copied back into the per-parameter gradient views;
returns the dp-averaged loss and the full (tp-gathered) gradients. Bug: the bucket is pre-divided
by the world size (tp * dp = 4) instead of the dp size, so the gradients come out halved."""
from enum import Enum, auto
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
import scalify

STYLE = "nanotron"
STEP = "training"
WORLD_SIZE = 4
BUG = "the gradient bucket is divided by the world size (4) instead of the data-parallel size (2) before the dp all-reduce"

HIDDEN, INTERMEDIATE, SEQ, GLOBAL_BATCH, TP, DP = 8, 16, 4, 2, 2, 2


class ParallelContext:
    """Ranks laid out as [dp, tp]: tp_pg = {0, 1}, {2, 3}; dp_pg = {0, 2}, {1, 3}."""

    def __init__(self, tensor_parallel_size: int, data_parallel_size: int):
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.world_pg = dist.group.WORLD
        world_size, rank = dist.get_world_size(), dist.get_rank()
        assert world_size == tensor_parallel_size * data_parallel_size
        self.world_ranks_to_pg = {}
        self.tp_pg: Optional[ProcessGroup] = None
        self.dp_pg: Optional[ProcessGroup] = None
        # every rank creates every group, in the same order
        for dp_rank in range(data_parallel_size):
            ranks = [dp_rank * tensor_parallel_size + tp_rank for tp_rank in range(tensor_parallel_size)]
            group = dist.new_group(ranks=ranks)
            self.world_ranks_to_pg[tuple(ranks)] = group
            if rank in ranks:
                self.tp_pg = group
        for tp_rank in range(tensor_parallel_size):
            ranks = [dp_rank * tensor_parallel_size + tp_rank for dp_rank in range(data_parallel_size)]
            group = dist.new_group(ranks=ranks)
            self.world_ranks_to_pg[tuple(ranks)] = group
            if rank in ranks:
                self.dp_pg = group


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


class DifferentiableIdentity(torch.autograd.Function):
    """All-reduce gradients in a differentiable fashion"""

    @staticmethod
    def forward(ctx, tensor, group: Optional[ProcessGroup]):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        group = ctx.group
        return DifferentiableAllReduceSum.apply(grad_output, group), None


class DifferentiableAllReduceSum(torch.autograd.Function):
    """All-reduce in a differentiable fashion"""

    @staticmethod
    def forward(ctx, tensor, group: Optional[ProcessGroup]):
        ctx.group = group
        if group.size() == 1:
            return tensor
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def differentiable_identity(tensor, group: Optional[ProcessGroup] = None):
    return DifferentiableIdentity.apply(tensor, group)


def differentiable_all_reduce_sum(tensor, group: Optional[ProcessGroup] = None):
    return DifferentiableAllReduceSum.apply(tensor, group)


def column_linear(input, weight, bias, group, tp_mode):
    if tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        input = differentiable_identity(input, group=group)
    return F.linear(input, weight, bias)


def row_linear(input, weight, bias, group, tp_mode):
    out = F.linear(input, weight, bias)
    if tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        out = differentiable_all_reduce_sum(out, group=group)
    return out


class TensorParallelColumnLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg: ProcessGroup, mode: TensorParallelLinearMode, bias=True):
        self.pg = pg
        self.world_size = pg.size()
        assert out_features % self.world_size == 0
        self.in_features = in_features
        self.out_features = out_features // self.world_size
        super().__init__(in_features=self.in_features, out_features=self.out_features, bias=bias)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(input=x, weight=self.weight, bias=self.bias, group=self.pg, tp_mode=self.mode)


class TensorParallelRowLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg: ProcessGroup, mode: TensorParallelLinearMode, bias=False):
        self.pg = pg
        self.world_size = pg.size()
        assert in_features % self.world_size == 0
        self.in_features = in_features // self.world_size
        self.out_features = out_features
        super().__init__(in_features=self.in_features, out_features=self.out_features, bias=bias)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(input=x, weight=self.weight, bias=self.bias, group=self.pg, tp_mode=self.mode)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


def sync_gradients_across_dp(named_grads, dp_pg: ProcessGroup):
    """One bucket: flatten, pre-divide (so the sum is the mean), all-reduce in place, copy back."""
    grads = [grad for _, grad in named_grads]
    grad_buffer = torch.cat([grad.view(-1) for grad in grads])
    grad_buffer.div_(dist.get_world_size())  # BUG
    dist.all_reduce(grad_buffer, op=dist.ReduceOp.SUM, group=dp_pg)
    offset = 0
    for grad in grads:
        numel = grad.numel()
        grad.copy_(grad_buffer[offset:offset + numel].view_as(grad))
        offset += numel
    return named_grads


def gather_tp_sharded(tensor, dim, tp_pg: ProcessGroup):
    shards = [torch.empty_like(tensor) for _ in range(tp_pg.size())]
    dist.all_gather(shards, tensor.contiguous(), group=tp_pg)
    return torch.cat(shards, dim=dim)


class MLP(nn.Module):
    def __init__(self, parallel_context: ParallelContext):
        super().__init__()
        tp_pg, tp_mode = parallel_context.tp_pg, TensorParallelLinearMode.ALL_REDUCE
        self.input_layernorm = RMSNorm(HIDDEN)
        self.up_proj = TensorParallelColumnLinear(HIDDEN, INTERMEDIATE, pg=tp_pg, mode=tp_mode, bias=True)
        self.act = nn.SiLU()
        self.down_proj = TensorParallelRowLinear(INTERMEDIATE, HIDDEN, pg=tp_pg, mode=tp_mode, bias=False)

    def forward(self, hidden_states):
        return self.down_proj(self.act(self.up_proj(self.input_layernorm(hidden_states))))


class TrainStep(nn.Module):
    def __init__(self, parallel_context: ParallelContext):
        super().__init__()
        self.parallel_context = parallel_context
        self.model = MLP(parallel_context)

    def forward(self, hidden_states, targets):
        pc = self.parallel_context
        dp_rank, dp_size = dist.get_rank(pc.dp_pg), pc.dp_pg.size()
        micro_batch_size = GLOBAL_BATCH // dp_size
        batch_slice = slice(dp_rank * micro_batch_size, (dp_rank + 1) * micro_batch_size)
        hidden_states, targets = hidden_states[batch_slice], targets[batch_slice]

        outputs = self.model(hidden_states)
        loss = F.mse_loss(outputs, targets)
        named_params = list(self.model.named_parameters())
        grads = torch.autograd.grad(loss, [p for _, p in named_params])
        named_grads = sync_gradients_across_dp(list(zip([n for n, _ in named_params], grads)), pc.dp_pg)

        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.SUM, group=pc.dp_pg)
        loss_avg = loss_avg / dp_size

        grads = dict(named_grads)
        return (loss_avg,
                grads["input_layernorm.weight"],
                gather_tp_sharded(grads["up_proj.weight"], 0, pc.tp_pg),
                gather_tp_sharded(grads["up_proj.bias"], 0, pc.tp_pg),
                gather_tp_sharded(grads["down_proj.weight"], 1, pc.tp_pg))


class ReferenceTrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.input_layernorm = RMSNorm(HIDDEN)
        self.model.up_proj = nn.Linear(HIDDEN, INTERMEDIATE)
        self.model.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, hidden_states, targets):
        m = self.model
        outputs = m.down_proj(F.silu(m.up_proj(m.input_layernorm(hidden_states))))
        loss = F.mse_loss(outputs, targets)
        grads = torch.autograd.grad(loss, list(m.parameters()))
        return (loss, *grads)


def reference() -> nn.Module:
    return ReferenceTrainStep()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return TrainStep(ParallelContext(tensor_parallel_size=TP, data_parallel_size=DP))


def shard(state, rank, world_size):
    tp_rank = rank % TP
    return {
        "model.input_layernorm.weight": state["model.input_layernorm.weight"].clone(),
        "model.up_proj.weight": state["model.up_proj.weight"].chunk(TP, 0)[tp_rank].clone(),
        "model.up_proj.bias": state["model.up_proj.bias"].chunk(TP, 0)[tp_rank].clone(),
        "model.down_proj.weight": state["model.down_proj.weight"].chunk(TP, 1)[tp_rank].clone(),
    }


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(GLOBAL_BATCH, SEQ, HIDDEN),
            "targets": torch.randn(GLOBAL_BATCH, SEQ, HIDDEN)}


INPUT_PLACEMENTS = {}   # replicated: each dp rank slices its own micro-batch
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
