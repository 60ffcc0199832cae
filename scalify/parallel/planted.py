"""Planted bugs: small variants of the correct layers, each a classic tensor-parallel mistake.

The line that does the wrong thing carries `# planted: <name>`; a verifier should point at it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.llama.modeling_llama import repeat_kv

from scalify.errors import ConfigError
from scalify.parallel.cross_entropy import VocabParallelCrossEntropy
from scalify.parallel.data import DataParallelStep, Grads, sum_over_ranks
from scalify.parallel.gpt2 import GPT2Parts, ParallelGPT2Attention
from scalify.parallel.layers import (
    SEQUENCE_DIM,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    all_reduce_sum,
    copy_to_tensor_parallel,
    divide,
    gather_sequence,
    own_chunk,
)
from scalify.parallel.llama import LlamaParts, ParallelLlamaAttention
from scalify.parallel.pipeline import LayerBlock, PipelineSchedule
from scalify.placements import Placement, Shard

PLANTED_BUGS: dict[str, str] = {
    "missing-allreduce": "llama o_proj returns its partial sum without the all_reduce",
    "global-heads-reshape": "gpt2 attention splits local q/k/v into the global number of heads",
    "bias-before-allreduce": "gpt2 attention c_proj adds its bias on every rank before the all_reduce",
    "column-wrong-dim": "llama q_proj holds the dim-1 shard of the weight and computes x @ weight",
    "vocab-mask-off-by-one": "vocab-parallel embedding keeps token id `end`, which belongs to the next rank",
    "softmax-wrong-dim": "llama attention softmax over dim 1 (the sharded heads) instead of the keys",
    "double-allreduce": "llama MLP down_proj all_reduces its output twice",
    "gqa-wrong-kv-head": "llama with fewer kv heads than ranks gives rank r kv head r % kv_heads",
    "sp-norm-grad-unreduced": "sequence-parallel llama: the final norm's weight gradient (a sum "
                              "over sequence shards) is not all-reduced",
    "sp-gather-grad-not-reduced": "sequence-parallel llama: the backward of q_proj's sequence "
                                  "all-gather keeps its own chunk instead of reduce-scattering",
    "sp-reduce-scatter-as-allreduce": "sequence-parallel llama: o_proj all-reduces its partial "
                                      "output and keeps its own sequence chunk, so the backward "
                                      "passes only that chunk's gradient instead of all-gathering",
    "sp-norm-wrong-shard": "sequence-parallel llama: the final norm runs on the gathered "
                           "sequence and each rank keeps the chunk starting at token `rank`, "
                           "not at `rank` chunks",
    "dp-mean-of-means": "data parallel: each micro-batch's loss is its own token mean, averaged "
                        "over micro-batches and ranks (not weighted by tokens)",
    "dp-grads-averaged": "data parallel: gradients of a loss already normalised by the global "
                         "token count are divided by the number of ranks",
    "dp-last-microbatch-unsynced": "data parallel: the gradients are all-reduced after the first "
                                   "micro-batch (no_sync around the others), so the last "
                                   "micro-batch's gradient stays local",
    "fused-plain-column-shard": "fused llama's shard function cuts [q; k; v] into equal row blocks, "
                                "not per head group",
    "pp-stage-boundary-dropped": "pipeline: stage 1 starts one layer later, so the layer at the "
                                 "boundary runs on no stage",
    "pp-stage-boundary-duplicated": "pipeline: stage 0 also runs stage 1's first layer, which "
                                    "runs on both stages",
    "pp-loss-normalised-per-microbatch": "pipeline: each micro-batch's loss is its own token "
                                         "mean, averaged over micro-batches",
}
PIPELINE_BUGS = ("pp-stage-boundary-dropped", "pp-stage-boundary-duplicated",
                         "pp-loss-normalised-per-microbatch")
DATA_PARALLEL_BUGS = ("dp-mean-of-means", "dp-grads-averaged", "dp-last-microbatch-unsynced")
PLANTED_BUGS.update({
    "ce-target-mask-off-by-one": "vocab-parallel loss: a rank keeps target class `end`, which "
                                 "belongs to the next rank",
    "ce-max-not-allreduced": "vocab-parallel loss: each rank shifts its logits by its own max",
    "ce-sum-not-allreduced": "vocab-parallel loss: the sum of exponentials is not all-reduced",
    "ce-loss-scaled-by-tp": "vocab-parallel loss: the mean is divided by the tensor-parallel size",
    "ce-sum-grad-allreduced": "vocab-parallel loss: the all-reduce of the sum of exponentials "
                              "also all-reduces its gradient (right forward, softmax gradient "
                              "scaled by the tensor-parallel size)",
})


class RowLinearWithoutAllReduce(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # planted: missing-allreduce


class GlobalHeadsGPT2Attention(ParallelGPT2Attention):
    def split_heads(self, states: torch.Tensor) -> torch.Tensor:
        return states.view(*states.shape[:-1], self.num_heads_global, -1).transpose(1, 2)  # planted: global-heads-reshape


class BiasBeforeAllReduceConv1D(RowParallelConv1D):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        partial = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)  # planted: bias-before-allreduce
        return all_reduce_sum(partial).view(size_out)


class TransposedColumnLinear(ColumnParallelLinear):
    """Holds weight[:, chunk] ([in, out/n], Conv1D layout) where nn.Linear's weight[chunk, :] belongs."""

    def __init__(self, in_features: int, out_features: int, num_chunks: int, *, bias: bool = False) -> None:
        super().__init__(in_features, out_features, num_chunks, bias=bias)
        self.weight = nn.Parameter(torch.empty(in_features, divide(out_features, num_chunks, "output features")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # planted: column-wrong-dim

    def placements(self) -> dict[str, Placement]:
        return {"weight": Shard(1), "bias": Shard(0)}


class OffByOneVocabEmbedding(VocabParallelEmbedding):
    def out_of_range(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (input_ids < self.vocab_start) | (input_ids > self.vocab_end)  # planted: vocab-mask-off-by-one


def softmax_over_heads_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's eager attention with the softmax taken over the heads dim."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=1, dtype=torch.float32).to(query.dtype)  # planted: softmax-wrong-dim
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class SoftmaxOverHeadsAttention(ParallelLlamaAttention):
    attention_function = staticmethod(softmax_over_heads_attention)


class DoubleAllReduceRowLinear(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(super().forward(x))  # planted: double-allreduce


def kv_head_of_rank_modulo(rank: int, world_size: int, kv_heads: int) -> int:
    return rank % kv_heads  # planted: gqa-wrong-kv-head


class UnreducedGradRMSNorm(SequenceParallelRMSNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)  # planted: sp-norm-grad-unreduced


class _GatherSequenceSplitGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        return gather_sequence(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return own_chunk(grad, SEQUENCE_DIM)  # planted: sp-gather-grad-not-reduced


class SplitGradColumnLinear(ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:  # the bug lives in the sequence gather
            return super().forward(x)
        return F.linear(_GatherSequenceSplitGrad.apply(x), self.weight, self.bias)


class AllReduceChunkRowLinear(RowParallelLinear):
    """Leaves sequence parallelism by all-reducing and narrowing to this rank's chunk: the forward
    equals the reduce-scatter, but the all-reduce's backward is the identity, not an all-gather."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:  # the bug lives in the sequence reduce-scatter
            return super().forward(x)
        output = own_chunk(all_reduce_sum(F.linear(x, self.weight)), SEQUENCE_DIM)  # planted: sp-reduce-scatter-as-allreduce
        return output if self.bias is None else output + self.bias


class WholeSequenceRMSNorm(SequenceParallelRMSNorm):
    """Normalises the gathered sequence and keeps a chunk of it, starting at token `rank`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        local = hidden_states.shape[SEQUENCE_DIM]
        normed = super().forward(gather_sequence(hidden_states))
        return normed.narrow(SEQUENCE_DIM, dist.get_rank(), local)  # planted: sp-norm-wrong-shard


class OffByOneTargetLoss(VocabParallelCrossEntropy):
    def outside(self, target: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return (target < start) | (target > end)  # planted: ce-target-mask-off-by-one


class LocalMaxLoss(VocabParallelCrossEntropy):
    def global_max(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.amax(-1, keepdim=True).detach()  # planted: ce-max-not-allreduced


class LocalSumLoss(VocabParallelCrossEntropy):
    def sum_of_exp(self, shifted: torch.Tensor) -> torch.Tensor:
        return shifted.exp().sum(-1)  # planted: ce-sum-not-allreduced


class SumGradientAllReducedLoss(VocabParallelCrossEntropy):
    def sum_of_exp(self, shifted: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(copy_to_tensor_parallel(shifted.exp().sum(-1)))  # planted: ce-sum-grad-allreduced


class TensorParallelScaledLoss(VocabParallelCrossEntropy):
    def mean(self, losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return losses.sum() / (labels != -100).sum() / dist.get_world_size()  # planted: ce-loss-scaled-by-tp


PLANTED_PARTS: dict[str, dict[str, LlamaParts | GPT2Parts]] = {
    "missing-allreduce": {"llama": LlamaParts(o_proj=RowLinearWithoutAllReduce)},
    "global-heads-reshape": {"gpt2": GPT2Parts(attention=GlobalHeadsGPT2Attention)},
    "bias-before-allreduce": {"gpt2": GPT2Parts(attn_c_proj=BiasBeforeAllReduceConv1D)},
    "column-wrong-dim": {"llama": LlamaParts(q_proj=TransposedColumnLinear)},
    "vocab-mask-off-by-one": {
        "llama": LlamaParts(embedding=OffByOneVocabEmbedding),
        "gpt2": GPT2Parts(embedding=OffByOneVocabEmbedding),
    },
    "softmax-wrong-dim": {"llama": LlamaParts(attention=SoftmaxOverHeadsAttention)},
    "double-allreduce": {"llama": LlamaParts(down_proj=DoubleAllReduceRowLinear)},
    "gqa-wrong-kv-head": {"llama": LlamaParts(kv_head_of_rank=kv_head_of_rank_modulo)},
    "sp-norm-grad-unreduced": {"llama": LlamaParts(final_norm=UnreducedGradRMSNorm)},
    "sp-gather-grad-not-reduced": {"llama": LlamaParts(q_proj=SplitGradColumnLinear)},
    "sp-reduce-scatter-as-allreduce": {"llama": LlamaParts(o_proj=AllReduceChunkRowLinear)},
    "sp-norm-wrong-shard": {"llama": LlamaParts(final_norm=WholeSequenceRMSNorm)},
    "ce-target-mask-off-by-one": {"llama": LlamaParts(loss=OffByOneTargetLoss)},
    "ce-max-not-allreduced": {"llama": LlamaParts(loss=LocalMaxLoss)},
    "ce-sum-not-allreduced": {"llama": LlamaParts(loss=LocalSumLoss)},
    "ce-loss-scaled-by-tp": {"llama": LlamaParts(loss=TensorParallelScaledLoss)},
    "ce-sum-grad-allreduced": {"llama": LlamaParts(loss=SumGradientAllReducedLoss)},
}
"""For each bug, the parts that plant it, per model family it applies to."""


class MeanOfMeansStep(DataParallelStep):
    def loss_of(self, model: nn.Module, inputs: dict[str, torch.Tensor],
                tokens: torch.Tensor) -> torch.Tensor:
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits
        share = dist.get_world_size() * self.micro_batches
        return ForCausalLMLoss(logits, inputs["labels"], logits.shape[-1]) / share  # planted: dp-mean-of-means


class AveragedGradsStep(DataParallelStep):
    def sync(self, grad: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(grad) / dist.get_world_size()  # planted: dp-grads-averaged


class FirstMicroBatchSyncedStep(DataParallelStep):
    """DDP's `no_sync` wrapped around every micro-batch but the first: the first one's backward
    all-reduces, the later gradients are added locally."""

    def accumulate(self, total: Grads | None, grads: Grads, index: int) -> Grads:
        if total is None:
            return [self.sync(g) for g in grads]
        return [t + g for t, g in zip(total, grads)]  # planted: dp-last-microbatch-unsynced


_DATA_PARALLEL_STEPS = {None: DataParallelStep, "dp-mean-of-means": MeanOfMeansStep,
                        "dp-grads-averaged": AveragedGradsStep,
                        "dp-last-microbatch-unsynced": FirstMicroBatchSyncedStep}


def data_parallel_step(planted_bug: str | None, names: tuple[str, ...], micro_batches: int,
                       zero_stage: int) -> DataParallelStep:
    """The data-parallel training step, with `planted_bug` planted if given."""
    if planted_bug not in _DATA_PARALLEL_STEPS:
        raise ConfigError(f"planted bug {planted_bug!r} does not apply to data parallelism; "
                          f"known: {', '.join(DATA_PARALLEL_BUGS)}")
    return _DATA_PARALLEL_STEPS[planted_bug](names, micro_batches, zero_stage)
def plain_column_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
                          world_size: int, config: object) -> torch.Tensor:
    """The fused [q; k; v] weight cut like one column-parallel weight: rank r gets rows r*n..(r+1)*n."""
    fused = torch.cat([q, k, v])
    rows = fused.shape[0] // world_size
    return fused[rank * rows:(rank + 1) * rows]  # planted: fused-plain-column-shard


PLANTED_QKV_ROWS = {"fused-plain-column-shard": plain_column_qkv_rows}
"""Bugs in the fused layout's shard function: the qkv rows function they plant."""


class LateStartSchedule(PipelineSchedule):
    def block(self, stage: int) -> LayerBlock:
        block = super().block(stage)
        return LayerBlock(block.start + 1, block.stop) if stage > 0 else block  # planted: pp-stage-boundary-dropped


class DuplicatedLayerSchedule(PipelineSchedule):
    """Stage 0 also holds stage 1's first layer and runs it (stage 1 runs it again)."""

    def block(self, stage: int) -> LayerBlock:
        block = super().block(stage)
        return LayerBlock(block.start, block.stop + (stage == 0))

    def run_layers(self, model: nn.Module, hidden: torch.Tensor,
                   attention_mask: torch.Tensor) -> torch.Tensor:
        context = self.layer_context(model, hidden, attention_mask)
        for layer in model.model.layers.values(): hidden = layer(hidden, **context)  # planted: pp-stage-boundary-duplicated
        return hidden


class PerMicroBatchLossSchedule(PipelineSchedule):
    def loss_of(self, logits: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, logits.shape[-1]) / self.micro_batches  # planted: pp-loss-normalised-per-microbatch


_PIPELINE_SCHEDULES = {None: PipelineSchedule, "pp-stage-boundary-dropped": LateStartSchedule,
                       "pp-stage-boundary-duplicated": DuplicatedLayerSchedule,
                       "pp-loss-normalised-per-microbatch": PerMicroBatchLossSchedule}


def pipeline_schedule(planted_bug: str | None, names: tuple[str, ...], stages: int, layers: int,
                      micro_batches: int) -> PipelineSchedule:
    """Stage 0's pipeline schedule (`replace(stage=s)` for the others), with `planted_bug`."""
    if planted_bug not in _PIPELINE_SCHEDULES:
        raise ConfigError(f"planted bug {planted_bug!r} does not apply to pipeline parallelism; "
                          f"known: {', '.join(PIPELINE_BUGS)}")
    return _PIPELINE_SCHEDULES[planted_bug](names, 0, stages, layers, micro_batches)
