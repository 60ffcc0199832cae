"""torchtitan Llama 3 feed-forward sub-block with sequence parallelism: ffn_norm under
SequenceParallel, PrepareModuleInput all-gathers the sequence, SwiGLU w1/w3 ColwiseParallel,
w2 RowwiseParallel reduce-scattering back to sequence shards; residual on the local shard."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import scalify

STYLE = "torchtitan"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

DIM, HIDDEN, SEQ = 16, 32, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FeedForwardBlock(nn.Module):
    """Second half of TransformerBlock: out = h + feed_forward(ffn_norm(h))."""

    def __init__(self):
        super().__init__()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward(DIM, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


def _load_local_shards_hook(module, state_dict, prefix, *args):
    for name, param in module.state_dict().items():
        key = prefix + name
        if isinstance(param, DTensor) and key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = DTensor.from_local(state_dict[key], param.device_mesh, param.placements,
                                                 run_check=False)


def reference() -> nn.Module:
    return FeedForwardBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_mesh = init_device_mesh("cpu", (world_size,))
    block = FeedForwardBlock()
    layer_plan = {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    parallelize_module(module=block, device_mesh=tp_mesh, parallelize_plan=layer_plan)
    block.register_load_state_dict_pre_hook(_load_local_shards_hook)
    return block


def inputs() -> dict[str, torch.Tensor]:
    return {"h": torch.randn(2, SEQ, DIM)}


PARAM_PLACEMENTS = {"feed_forward.w1.weight": scalify.Shard(0),
                    "feed_forward.w3.weight": scalify.Shard(0),
                    "feed_forward.w2.weight": scalify.Shard(1)}
INPUT_PLACEMENTS = {"h": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Shard(1)]
