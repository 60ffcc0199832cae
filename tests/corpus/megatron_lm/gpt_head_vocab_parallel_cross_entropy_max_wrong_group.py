"""Megatron-LM (mpu) vocab_parallel_cross_entropy training step -- BUG: the logits max is
all-reduced over the data-parallel group instead of the tensor-parallel group, so each rank
subtracts its own local max and the summed exponentials mix scales."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "training"
WORLD_SIZE = 2
BUG = 'The logits_max all-reduce uses the data-parallel group instead of the tensor-model-parallel group, so the vocab shards subtract different maxima before their exp-sums are added.'

VOCAB, HIDDEN, SEQ, BATCH = 64, 16, 8, 2

_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_=1):
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    world_size, rank, tp = dist.get_world_size(), dist.get_rank(), tensor_model_parallel_size_
    for i in range(tp):
        ranks = list(range(i, world_size, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
    for i in range(world_size // tp):
        ranks = list(range(i * tp, (i + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_data_parallel_group():
    return _DATA_PARALLEL_GROUP


def get_tensor_model_parallel_rank():
    return dist.get_rank(group=_TENSOR_MODEL_PARALLEL_GROUP)


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=_TENSOR_MODEL_PARALLEL_GROUP)


def get_tensor_model_parallel_src_rank():
    """Global rank of local rank 0 in the tensor model parallel group."""
    local_world_size = get_tensor_model_parallel_world_size()
    return (dist.get_rank() // local_world_size) * local_world_size


def broadcast_data(keys, data, datatype):
    """Only tensor-parallel rank 0 reads the batch: broadcast it to the rest of the group."""
    key_numel = {key: data[key].numel() for key in keys}
    total_numel = sum(key_numel.values())
    if get_tensor_model_parallel_rank() == 0:
        flatten_data = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(datatype)
    else:
        flatten_data = torch.empty(total_numel, dtype=datatype)
    dist.broadcast(flatten_data, get_tensor_model_parallel_src_rank(), group=get_tensor_model_parallel_group())
    output, offset = {}, 0
    for key in keys:
        output[key] = flatten_data.narrow(0, offset, key_numel[key]).view(data[key].shape)
        offset += key_numel[key]
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        dist.all_reduce(grad_output, group=get_tensor_model_parallel_group())
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=get_tensor_model_parallel_group())
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        # Maximum value along vocab dimension across all GPUs.
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=get_data_parallel_group())  # BUG
        # Subtract the maximum value.
        vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

        partition_vocab_size = vocab_parallel_logits.size()[-1]
        vocab_start_index = get_tensor_model_parallel_rank() * partition_vocab_size
        vocab_end_index = vocab_start_index + partition_vocab_size

        # Create a mask of valid vocab ids (1 means it needs to be masked).
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits, op=dist.ReduceOp.SUM, group=get_tensor_model_parallel_group())

        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=get_tensor_model_parallel_group())

        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= (1.0 - target_mask.view(-1).to(grad_2d.dtype))
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.num_embeddings_per_partition = num_embeddings // get_tensor_model_parallel_world_size()
        self.vocab_start_index = get_tensor_model_parallel_rank() * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))

    def forward(self, input_):
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[input_mask] = 0
        output_parallel = F.embedding(masked_input, self.weight)
        output_parallel[input_mask, :] = 0.0
        return _ReduceFromModelParallelRegion.apply(output_parallel)


def parallel_lm_logits(input_, word_embeddings_weight):
    input_parallel = _CopyToModelParallelRegion.apply(input_)
    return F.linear(input_parallel, word_embeddings_weight)


class GPTModel(nn.Module):
    def __init__(self):
        super().__init__()
        initialize_model_parallel(dist.get_world_size())
        self.word_embeddings = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.final_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens, position_ids, labels, loss_mask):
        data_b = broadcast_data(["tokens", "labels"], {"tokens": tokens, "labels": labels}, torch.int64)
        tokens, labels = data_b["tokens"], data_b["labels"]
        hidden = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        hidden = hidden.transpose(0, 1).contiguous()                     # [s, b, h]
        hidden = self.final_layernorm(hidden)
        output = parallel_lm_logits(hidden, self.word_embeddings.weight)  # [s, b, v/p]
        labels = labels.transpose(0, 1).contiguous()
        losses = vocab_parallel_cross_entropy(output, labels).transpose(0, 1).contiguous()
        loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        params = [p for _, p in self.named_parameters()]
        return (loss, *torch.autograd.grad(loss, params))


class ReferenceGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.final_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens, position_ids, labels, loss_mask):
        hidden = self.final_layernorm(self.word_embeddings(tokens) + self.position_embeddings(position_ids))
        logits = hidden @ self.word_embeddings.weight.t()
        losses = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="none")
        loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    return ReferenceGPT()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return GPTModel()


def inputs() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[1, -2:] = 0.0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).repeat(BATCH, 1), "loss_mask": loss_mask}


PARAM_PLACEMENTS = {"word_embeddings.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(0), scalify.Replicate(), scalify.Replicate(),
                     scalify.Replicate()]
