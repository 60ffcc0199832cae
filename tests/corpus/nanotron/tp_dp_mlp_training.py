"""nanotron training step on 4 ranks (ParallelContext tp=2 x dp=2): each dp rank takes its slice of
the global batch, runs a TP MLP in ALL_REDUCE mode, averages its gradients over dp_pg with async
all-reduces, and reports the dp-averaged loss, the tp-replicated grads and down_proj's full
gradient (all_gather over tp_pg into a list, then torch.cat) for the optimizer checkpoint."""
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "nanotron"
STEP = "training"
WORLD_SIZE = 4
BUG = None

HIDDEN, INTERMEDIATE, SEQ, GLOBAL_BATCH, TP, DP = 8, 16, 4, 4, 2, 2


class ParallelContext:
    def __init__(self, tensor_parallel_size, data_parallel_size, pipeline_parallel_size=1):
        ranks = torch.arange(dist.get_world_size()).reshape(
            pipeline_parallel_size, data_parallel_size, tensor_parallel_size)
        self.tensor_parallel_size, self.data_parallel_size = tensor_parallel_size, data_parallel_size
        self.tp_pg = self.create_new_group(ranks.reshape(-1, tensor_parallel_size))
        self.dp_pg = self.create_new_group(ranks.transpose(1, 2).reshape(-1, data_parallel_size))

    def create_new_group(self, all_groups_ranks):
        rank, mine = dist.get_rank(), None
        for group_ranks in all_groups_ranks.tolist():
            new_group = dist.new_group(ranks=group_ranks)
            if rank in group_ranks:
                mine = new_group
        return mine


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


class DifferentiableIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableAllReduceSum.apply(grad_output, ctx.group), None


class DifferentiableAllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableIdentity.apply(grad_output, ctx.group), None


class TensorParallelColumnLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=True):
        self.pg, self.mode = pg, mode
        super().__init__(in_features, out_features // dist.get_world_size(pg), bias=bias)

    def forward(self, x):
        return F.linear(DifferentiableIdentity.apply(x, self.pg), self.weight, self.bias)


class TensorParallelRowLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode):
        self.pg, self.mode = pg, mode
        super().__init__(in_features // dist.get_world_size(pg), out_features, bias=False)

    def forward(self, x):
        return DifferentiableAllReduceSum.apply(F.linear(x, self.weight), self.pg)


class Model(nn.Module):
    def __init__(self, parallel_context):
        super().__init__()
        self.parallel_context = parallel_context
        pg, mode = parallel_context.tp_pg, TensorParallelLinearMode.ALL_REDUCE
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.up_proj = TensorParallelColumnLinear(HIDDEN, INTERMEDIATE, pg=pg, mode=mode)
        self.down_proj = TensorParallelRowLinear(INTERMEDIATE, HIDDEN, pg=pg, mode=mode)

    def forward(self, hidden_states, targets):
        pc = self.parallel_context
        dp_rank, dp_size = dist.get_rank(pc.dp_pg), dist.get_world_size(pc.dp_pg)
        micro_batch = GLOBAL_BATCH // dp_size
        hidden_states = hidden_states[:, dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        targets = targets[:, dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        out = self.down_proj(F.gelu(self.up_proj(self.input_layernorm(hidden_states))))
        loss = F.mse_loss(out, targets)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        # sync_gradients_across_dp: average
        handles = []
        for grad in grads:
            grad.div_(dp_size)
            handles.append(dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=pc.dp_pg, async_op=True))
        loss_avg = loss.detach().clone()
        handles.append(dist.all_reduce(loss_avg, group=pc.dp_pg, async_op=True))
        for handle in handles:
            handle.wait()
        loss_avg = loss_avg / dp_size
        ln_w, ln_b, up_w, up_b, down_w = grads
        shards = [torch.empty_like(down_w) for _ in range(dist.get_world_size(pc.tp_pg))]
        dist.all_gather(shards, down_w.contiguous(), group=pc.tp_pg)
        full_down_w = torch.cat(shards, dim=1)
        return loss_avg, ln_w, ln_b, full_down_w


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, hidden_states, targets):
        out = self.down_proj(F.gelu(self.up_proj(self.input_layernorm(hidden_states))))
        loss = F.mse_loss(out, targets)
        ln_w, ln_b, _, _, down_w = torch.autograd.grad(loss, list(self.parameters()))
        return loss, ln_w, ln_b, down_w


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return Model(ParallelContext(tensor_parallel_size=TP, data_parallel_size=DP))


def shard(state, rank, world_size):
    tp_rank = rank % TP
    out = {k: v.clone() for k, v in state.items() if k.startswith("input_layernorm")}
    out["up_proj.weight"] = state["up_proj.weight"].chunk(TP, 0)[tp_rank].clone()
    out["up_proj.bias"] = state["up_proj.bias"].chunk(TP, 0)[tp_rank].clone()
    out["down_proj.weight"] = state["down_proj.weight"].chunk(TP, 1)[tp_rank].clone()
    return out


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(SEQ, GLOBAL_BATCH, HIDDEN), "targets": torch.randn(SEQ, GLOBAL_BATCH, HIDDEN)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 4
