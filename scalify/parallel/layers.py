"""Megatron-style tensor-parallel layers: local shards of a layer plus the collectives that join them.

Every layer reports, through `placements()`, how its local parameters relate to the reference
layer's parameters; the collectives run on the default process group (`dist.group.WORLD`).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from scalify.errors import ShapeError
from scalify.placements import Placement, Replicate, Shard


def divide(total: int, parts: int, what: str) -> int:
    """`total / parts`, or a ShapeError naming `what` when the split is uneven."""
    if total % parts != 0:
        raise ShapeError(f"{what} ({total}) does not split evenly into {parts} tensor-parallel shards")
    return total // parts


def _sum_over_ranks(partial: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(partial, "sum", dist.group.WORLD)


def sum_over_rank_blocks(partial: torch.Tensor, block: int) -> torch.Tensor:
    """Sum `partial` over this rank's block of `block` consecutive ranks (e.g. the ranks that
    share one replicated kv head); every rank creates every block's group, as Megatron does."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + block))) for start in range(0, world, block)]
    return funcol.all_reduce(partial, "sum", groups[rank // block])


def _gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    # The dim is passed non-negative: funcol's view shortcut (taken when dim 0 equals the group
    # size) computes a wrong shape for gather_dim=-1.
    return funcol.all_gather_single(local, dim % local.dim(), dist.group.WORLD)


def own_chunk(full: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's equal chunk of `full` along `dim`."""
    size = divide(full.shape[dim], dist.get_world_size(), f"dim {dim} of a gathered tensor")
    return full.narrow(dim, dist.get_rank() * size, size)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward; the input gradient is summed over the ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(grad)


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: sum over the ranks forward; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(partial)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _GatherReplicated(torch.autograd.Function):
    """Concatenate the ranks' tensors along `dim` into a value every rank then uses alike; the
    gradient is this rank's chunk."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _gather(local, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return own_chunk(grad, ctx.dim), None


SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]


def _gather_sequence(local: torch.Tensor) -> torch.Tensor:
    return funcol.all_gather_single(local, SEQUENCE_DIM, dist.group.WORLD)


def _reduce_scatter_sequence(partial: torch.Tensor) -> torch.Tensor:
    return funcol.reduce_scatter_single(partial, "sum", SEQUENCE_DIM, dist.group.WORLD)


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism entering a column-parallel layer: all-gather the sequence shards;
    the (partial) gradient is summed and scattered back."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        return _gather_sequence(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_sequence(grad)


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism leaving a row-parallel layer: sum the partial outputs and keep this
    rank's sequence shard; the gradient is all-gathered."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_sequence(partial)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather_sequence(grad)


def gather_sequence(local: torch.Tensor) -> torch.Tensor:
    """The whole sequence from every rank's shard (sequence parallelism)."""
    return _GatherSequence.apply(local)


def reduce_scatter_sequence(partial: torch.Tensor) -> torch.Tensor:
    """This rank's sequence shard of the sum of every rank's `partial`."""
    return _ReduceScatterSequence.apply(partial)


def copy_to_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Mark a replicated activation entering sharded compute (its gradient is all-reduced)."""
    return _CopyToTensorParallel.apply(x)


def all_reduce_sum(partial: torch.Tensor) -> torch.Tensor:
    """Sum `partial` over the ranks of the tensor-parallel group."""
    return _ReduceFromTensorParallel.apply(partial)


def all_gather_last_dim(local: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' `local` tensors along the last dim."""
    return _GatherReplicated.apply(local, local.dim() - 1)


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' `local` tensors along dim 0, for every rank to use alike."""
    return _GatherReplicated.apply(local, 0)


class ColumnParallelLinear(nn.Linear):
    """nn.Linear holding one of `num_chunks` row blocks of the weight [out, in]: output features are sharded.

    `chunk_of_rank[r]` names the block rank r holds when it is not block r (replicated GQA kv heads).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_chunks: int,
        *,
        bias: bool = False,
        chunk_of_rank: tuple[int, ...] | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(in_features, divide(out_features, num_chunks, "output features"), bias=bias)
        self.chunk_of_rank = chunk_of_rank
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x) if self.sequence_parallel else copy_to_tensor_parallel(x)
        return F.linear(x, self.weight, self.bias)

    def placements(self) -> dict[str, Placement]:
        shard = Shard(0, chunk_of_rank=self.chunk_of_rank)
        return {"weight": shard, "bias": shard}


class RowParallelLinear(nn.Linear):
    """nn.Linear holding a column block of the weight [out, in]: partial outputs are summed, then the bias added."""

    def __init__(self, in_features: int, out_features: int, num_chunks: int, *, bias: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__(divide(in_features, num_chunks, "input features"), out_features, bias=bias)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        output = reduce_scatter_sequence(partial) if self.sequence_parallel else all_reduce_sum(partial)
        return output if self.bias is None else output + self.bias

    def placements(self) -> dict[str, Placement]:
        return {"weight": Shard(1), "bias": Replicate()}


class VocabParallelEmbedding(nn.Module):
    """Embedding holding the rows [start, end) of the vocabulary; tokens outside that range contribute zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, rank: int, world_size: int, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        rows = divide(num_embeddings, world_size, "vocab_size")
        self.vocab_start = rank * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        self.sequence_parallel = sequence_parallel

    def out_of_range(self, input_ids: torch.Tensor) -> torch.Tensor:
        """True where a token id belongs to another rank's rows."""
        return (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = self.out_of_range(input_ids)
        local_ids = (input_ids - self.vocab_start).masked_fill(mask, 0)
        partial = F.embedding(local_ids, self.weight)
        partial = partial.masked_fill(mask.unsqueeze(-1), 0.0)
        return reduce_scatter_sequence(partial) if self.sequence_parallel else all_reduce_sum(partial)

    def placements(self) -> dict[str, Placement]:
        return {"weight": Shard(0)}


class SequenceParallelRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm on this rank's sequence shard: the weight is replicated, so its gradient (a
    partial sum over the shards) is all-reduced."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return copy_to_tensor_parallel(self.weight) * hidden_states.to(input_dtype)


class ColumnParallelConv1D(Conv1D):
    """HF Conv1D (weight [in, out]) holding a column block of each of `blocks` fused output blocks.

    GPT-2's c_attn has blocks=3: the local weight is [q_r | k_r | v_r].
    """

    def __init__(self, nf: int, nx: int, num_chunks: int, *, blocks: int = 1) -> None:
        super().__init__(divide(nf, num_chunks * blocks, "output features") * blocks, nx)
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_tensor_parallel(x))

    def placements(self) -> dict[str, Placement]:
        return {"weight": Shard(1, blocks=self.blocks), "bias": Shard(0, blocks=self.blocks)}


class RowParallelConv1D(Conv1D):
    """HF Conv1D (weight [in, out]) holding a row block of the weight; the replicated bias is added after the sum."""

    def __init__(self, nf: int, nx: int, num_chunks: int) -> None:
        super().__init__(nf, divide(nx, num_chunks, "input features"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        output = all_reduce_sum(torch.mm(x.view(-1, x.size(-1)), self.weight))
        return (output + self.bias).view(size_out)

    def placements(self) -> dict[str, Placement]:
        return {"weight": Shard(0), "bias": Replicate()}


@runtime_checkable
class GradSync(Protocol):
    """A layer whose parameters' gradients need a sync after the backward pass."""

    def sync_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The synced gradients of those of its parameters (by local name) that need one."""


class ParallelCausalLM(nn.Module):
    """A backbone (under HF's attribute name, so parameter names match) and a column-parallel
    lm_head, tied to the vocab-parallel embedding when the config ties them; logits are gathered
    or left vocab-parallel."""

    def __init__(self, backbone_name: str, backbone: nn.Module, embedding: nn.Module, hidden: int,
                 vocab: int, world_size: int, *, tie: bool, gather_logits: bool,
                 sequence_parallel: bool = False,
                 vocab_parallel_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.vocab_parallel_loss = vocab_parallel_loss
        self.backbone_name = backbone_name
        self.add_module(backbone_name, backbone)
        self.lm_head = ColumnParallelLinear(hidden, vocab, world_size, sequence_parallel=sequence_parallel)
        if tie:
            self.lm_head.weight = embedding.weight
        self.gather_logits = gather_logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or with `labels` the mean next-token cross-entropy (HF's loss)."""
        hidden_states = getattr(self, self.backbone_name)(input_ids, attention_mask)
        hidden_states = slice_logits_to_keep(hidden_states, 0)
        logits = self.lm_head(hidden_states)
        logits = all_gather_last_dim(logits) if self.gather_logits else logits
        if labels is None:
            return logits
        if not self.gather_logits:
            return self.vocab_parallel_loss(logits, labels)
        return ForCausalLMLoss(logits, labels, logits.shape[-1])

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients after the step's synchronisation: each `GradSync` layer syncs its own
        (replicated fused kv rows); plain TP needs nothing else."""
        synced = dict(grads)
        for prefix, layer in self.named_modules():
            if isinstance(layer, GradSync):
                own = {local: synced[f"{prefix}.{local}"] for local, _ in layer.named_parameters()
                       if f"{prefix}.{local}" in synced}
                synced.update({f"{prefix}.{local}": grad
                               for local, grad in layer.sync_grads(own).items()})
        return synced
