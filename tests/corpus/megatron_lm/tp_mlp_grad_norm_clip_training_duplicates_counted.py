"""Megatron-LM TP=2 training step with clip_grad_norm_fp32, but TP-duplicated params (LayerNorm,
row bias) are counted on every TP rank, so the all-reduced grad norm is too large."""
import torch
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "megatron_lm"
STEP = "training"
WORLD_SIZE = 2
BUG = ("The grad norm counts the tensor-parallel-duplicated LayerNorm and row-bias gradients on every TP rank, not only on TP rank 0, so the norm is too large and the clip too strong.")

HIDDEN_SIZE = 8
FFN_HIDDEN_SIZE = 16
SEQ_LENGTH = 4
MICRO_BATCH_SIZE = 1
CLIP_GRAD = 0.05  # args.clip_grad: small, so the clip is really applied


# ---------------------------------------------------------------- megatron/core/tensor_parallel
def _reduce(input_, group):
    """All-reduce the input tensor across the model parallel group."""
    if torch.distributed.get_world_size(group=group) == 1:
        return input_
    torch.distributed.all_reduce(input_, group=group)
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Pass the input to the model parallel region."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def copy_to_tensor_model_parallel_region(input_, group):
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_, group):
    return _ReduceFromModelParallelRegion.apply(input_, group)


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def param_is_not_tensor_parallel_duplicate(param, tp_rank):
    return (hasattr(param, "tensor_model_parallel") and param.tensor_model_parallel) or (
        tp_rank == 0
    )


def param_is_not_shared(param):
    return not hasattr(param, "shared") or not param.shared


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split along its second dimension: A = [A_1, ..., A_p]."""

    def __init__(self, input_size, output_size, tp_group):
        super().__init__()
        self.tp_group = tp_group
        world_size = torch.distributed.get_world_size(group=tp_group)
        self.output_size_per_partition = output_size // world_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition))
        set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)

    def forward(self, input_):
        input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = F.linear(input_parallel, self.weight, self.bias)
        return output_parallel


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split along its first dimension and X along its second."""

    def __init__(self, input_size, output_size, tp_group):
        super().__init__()
        self.tp_group = tp_group
        world_size = torch.distributed.get_world_size(group=tp_group)
        self.input_size_per_partition = input_size // world_size
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)
        # The bias is added after the all-reduce: a TP duplicate (no tensor_model_parallel attr).
        self.bias = nn.Parameter(torch.empty(output_size))

    def forward(self, input_):
        output_parallel = F.linear(input_, self.weight)
        output_ = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        output = output_ + self.bias
        return output


# ---------------------------------------------------------------- megatron/core/optimizer/clip_grads.py
def get_grad_norm_fp32(grads_for_norm, norm_type, model_parallel_group):
    total_norm = torch.zeros((), dtype=grads_for_norm[0].dtype)
    for grad in grads_for_norm:
        grad_norm = torch.norm(grad, norm_type)
        total_norm = total_norm + grad_norm ** norm_type
    # Sum across all model-parallel GPUs.
    torch.distributed.all_reduce(
        total_norm, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group
    )
    total_norm = total_norm ** (1.0 / norm_type)
    return total_norm


def clip_grad_norm_fp32(parameters, grads, max_norm, tp_rank, model_parallel_group, norm_type=2):
    grads_for_norm = []
    for param, grad in zip(parameters, grads):
        grad_not_none = grad is not None
        is_not_shared = param_is_not_shared(param)
        is_not_tp_duplicate = param_is_not_tensor_parallel_duplicate(param, tp_rank)
        if grad_not_none and is_not_shared:  # BUG
            grads_for_norm.append(grad)
    total_norm = get_grad_norm_fp32(grads_for_norm, norm_type, model_parallel_group)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    clip_coeff_clamped = torch.clamp(clip_coeff, max=1.0)
    return [grad * clip_coeff_clamped for grad in grads], total_norm


# ---------------------------------------------------------------- megatron/model/transformer.py
class ParallelMLP(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(HIDDEN_SIZE, FFN_HIDDEN_SIZE, tp_group)
        self.dense_4h_to_h = RowParallelLinear(FFN_HIDDEN_SIZE, HIDDEN_SIZE, tp_group)

    def forward(self, hidden_states):
        intermediate_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = F.gelu(intermediate_parallel)
        output = self.dense_4h_to_h(intermediate_parallel)
        return output


class ParallelMLPBlock(nn.Module):
    """[s, b, h] -> LayerNorm -> ParallelMLP; forward runs one training step up to the clip."""

    def __init__(self, tp_rank, tp_group):
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_group = tp_group
        # Replicated on every TP rank: no tensor_model_parallel attribute.
        self.input_layernorm = nn.LayerNorm(HIDDEN_SIZE, eps=1e-5)
        self.mlp = ParallelMLP(tp_group)

    def forward(self, hidden_states, labels):
        params = list(self.parameters())
        layernorm_output = self.input_layernorm(hidden_states)
        output = self.mlp(layernorm_output)
        loss = F.mse_loss(output, labels)
        grads = torch.autograd.grad(loss, params)
        grads, _ = clip_grad_norm_fp32(params, grads, CLIP_GRAD, self.tp_rank, self.tp_group)
        return (loss, *grads)


# ---------------------------------------------------------------- single-device reference
class ReferenceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN_SIZE, FFN_HIDDEN_SIZE)
        self.dense_4h_to_h = nn.Linear(FFN_HIDDEN_SIZE, HIDDEN_SIZE)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


class ReferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN_SIZE, eps=1e-5)
        self.mlp = ReferenceMLP()

    def forward(self, hidden_states, labels):
        params = list(self.parameters())
        output = self.mlp(self.input_layernorm(hidden_states))
        loss = F.mse_loss(output, labels)
        grads = torch.autograd.grad(loss, params)
        # torch.nn.utils.clip_grad_norm_ math on the full gradients.
        total_norm = torch.norm(torch.stack([torch.norm(g, 2.0) for g in grads]), 2.0)
        clip_coef = CLIP_GRAD / (total_norm + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        return (loss, *[g * clip_coef_clamped for g in grads])


def reference() -> nn.Module:
    return ReferenceBlock()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_group = torch.distributed.new_group(ranks=list(range(world_size)))
    tp_rank = torch.distributed.get_rank(group=tp_group)
    return ParallelMLPBlock(tp_rank, tp_group)


def inputs() -> dict[str, torch.Tensor]:
    return {
        "hidden_states": torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE),
        "labels": torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE),
    }


PARAM_PLACEMENTS = {
    "mlp.dense_h_to_4h.weight": scalify.Shard(0),
    "mlp.dense_h_to_4h.bias": scalify.Shard(0),
    "mlp.dense_4h_to_h.weight": scalify.Shard(1),
}
OUTPUT_PLACEMENTS = [
    scalify.Replicate(),  # loss
    scalify.Replicate(),  # input_layernorm.weight
    scalify.Replicate(),  # input_layernorm.bias
    scalify.Shard(0),  # mlp.dense_h_to_4h.weight
    scalify.Shard(0),  # mlp.dense_h_to_4h.bias
    scalify.Shard(1),  # mlp.dense_4h_to_h.weight
    scalify.Replicate(),  # mlp.dense_4h_to_h.bias
]
