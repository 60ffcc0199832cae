"""nanotron-style vocab-parallel token embedding (out-of-range ids masked, partial rows
all-reduced) whose weight is tied to a column-parallel LM head giving vocab-sharded logits."""
import math
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "nanotron"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

VOCAB_SIZE = 32
HIDDEN_SIZE = 8
RMS_NORM_EPS = 1e-6


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


# ---- nanotron.parallel.tensor_parallel.distributed_differentiable_primitives

class DifferentiableIdentity(torch.autograd.Function):
    """All-reduce gradients in a differentiable fashion"""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        group = ctx.group
        return DifferentiableAllReduceSum.apply(grad_output, group), None


class DifferentiableAllReduceSum(torch.autograd.Function):
    """All-reduce in a differentiable fashion"""

    @staticmethod
    def forward(ctx, tensor, group):
        if dist.get_world_size(group) == 1:
            return tensor
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def differentiable_identity(tensor, group=None):
    return DifferentiableIdentity.apply(tensor, group)


def differentiable_all_reduce_sum(tensor, group=None):
    return DifferentiableAllReduceSum.apply(tensor, group)


# ---- nanotron.parallel.tensor_parallel.functional

def column_linear(input, weight, bias, group, tp_mode):
    if tp_mode is TensorParallelLinearMode.ALL_REDUCE:
        input = differentiable_identity(input, group=group)
    else:
        raise ValueError(f"Got unexpected mode: {tp_mode}.")
    return F.linear(input, weight, bias)


# ---- nanotron.parallel.tensor_parallel.nn

class TensorParallelColumnLinear(nn.Linear):
    def __init__(self, in_features, out_features, pg, mode, bias=True, device=None, dtype=None):
        self.pg = pg
        self.world_size = pg.size()
        assert out_features % self.world_size == 0
        self.in_features = in_features
        self.out_features = out_features // self.world_size
        super().__init__(in_features=self.in_features, out_features=self.out_features,
                         bias=bias, device=device, dtype=dtype)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(input=x, weight=self.weight, bias=self.bias, group=self.pg,
                             tp_mode=self.mode)


class TensorParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, pg, mode=None, padding_idx=None,
                 device=None, dtype=None):
        self.pg = pg
        self.rank = dist.get_rank(self.pg)
        self.world_size = pg.size()

        self.original_num_embeddings = num_embeddings

        assert num_embeddings % self.world_size == 0
        block_size = num_embeddings // self.world_size
        # inputs in `[min_id, max_id[` are handled by `self` to get embeddings
        self.min_id = self.rank * block_size
        self.max_id = (self.rank + 1) * block_size

        super().__init__(block_size, embedding_dim, padding_idx=padding_idx, device=device,
                         dtype=dtype)
        self.mode = mode if mode is not None else TensorParallelLinearMode.ALL_REDUCE

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.pg.size() > 1:
            # Move the ids into this rank's local row numbering, then mask the ones it does not own
            masked_input = input_ids.clone() - self.min_id
            input_mask = (masked_input < 0) | (masked_input >= self.num_embeddings)
            masked_input[input_mask] = 0
        else:
            masked_input = input_ids
        out = super().forward(masked_input)

        if self.pg.size() > 1:
            out = out * (~input_mask[..., None])

        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            out = differentiable_all_reduce_sum(out, group=self.pg)
        else:
            raise ValueError(f"Got unexpected mode: {self.mode}.")
        return out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


def tie_parameters(root_module: nn.Module, ties: list[str]) -> None:
    """Make every name in `ties` share the first one's parameter (cf. nanotron's tie_parameters)."""
    def split(name):
        module_name, _, param_name = name.rpartition(".")
        return root_module.get_submodule(module_name), param_name

    owner, param_name = split(ties[0])
    tied = getattr(owner, param_name)
    for name in ties[1:]:
        module, param_name = split(name)
        setattr(module, param_name, tied)


# ---- model

class TiedEmbeddingLM(nn.Module):
    """Token embedding -> final norm -> LM head tied with the embedding, on one device."""

    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)
        self.final_layer_norm = RMSNorm(HIDDEN_SIZE, eps=RMS_NORM_EPS)
        self.lm_head = nn.Linear(HIDDEN_SIZE, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.token_embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.token_embedding(input_ids)
        hidden_states = self.final_layer_norm(hidden_states)
        return self.lm_head(hidden_states)


class TensorParallelTiedEmbeddingLM(nn.Module):
    def __init__(self, tp_pg):
        super().__init__()
        tp_mode = TensorParallelLinearMode.ALL_REDUCE
        self.token_embedding = TensorParallelEmbedding(
            num_embeddings=VOCAB_SIZE, embedding_dim=HIDDEN_SIZE, pg=tp_pg, mode=tp_mode)
        self.final_layer_norm = RMSNorm(HIDDEN_SIZE, eps=RMS_NORM_EPS)
        # sharded logits: the caller (sharded cross-entropy) works on the vocab shards
        self.lm_head = TensorParallelColumnLinear(
            in_features=HIDDEN_SIZE, out_features=VOCAB_SIZE, pg=tp_pg, mode=tp_mode,
            bias=False)
        tie_parameters(self, ["token_embedding.weight", "lm_head.weight"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.token_embedding(input_ids)
        hidden_states = self.final_layer_norm(hidden_states)
        sharded_logits = self.lm_head(hidden_states)
        return sharded_logits


def reference() -> nn.Module:
    return TiedEmbeddingLM()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_pg = dist.new_group(ranks=list(range(world_size)))
    return TensorParallelTiedEmbeddingLM(tp_pg)


def inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB_SIZE, (2, 6))}


# the tied weight appears once in the reference's parameters, under the embedding's name
PARAM_PLACEMENTS = {"token_embedding.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Shard(-1)]
