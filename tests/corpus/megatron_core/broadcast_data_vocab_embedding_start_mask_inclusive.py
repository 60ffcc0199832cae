"""Megatron-Core get_batch + embedding: tensor_parallel.broadcast_data flattens tokens and labels
on TP rank 0 into one int64 buffer broadcast over the TP group (other ranks receive into an empty
buffer and unpack with narrow/view), then a VocabParallelEmbedding (vocab range from VocabUtility,
out-of-range ids masked, partial lookups all-reduced) embeds the tokens as [s, b, h] and scores
each position against the embedding of its label. Bug: the mask treats the partition's start
index as out of range, so the first id of every vocab partition embeds to zeros."""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "forward"
WORLD_SIZE = 2
BUG = "the vocab mask compares the start index with <= instead of <, masking out the first id of each partition"


@dataclass
class TransformerConfig:
    hidden_size: int = 8
    padded_vocab_size: int = 32
    micro_batch_size: int = 2
    seq_length: int = 4
    tensor_model_parallel_size: int = 2
    params_dtype: Optional[torch.dtype] = None   # None: torch.get_default_dtype()


class parallel_state:
    _TENSOR_MODEL_PARALLEL_GROUP = None

    @classmethod
    def initialize_model_parallel(cls, tensor_model_parallel_size=1):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        for i in range(world_size // tensor_model_parallel_size):
            ranks = range(i * tensor_model_parallel_size, (i + 1) * tensor_model_parallel_size)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                cls._TENSOR_MODEL_PARALLEL_GROUP = group

    @classmethod
    def get_tensor_model_parallel_group(cls):
        return cls._TENSOR_MODEL_PARALLEL_GROUP

    @classmethod
    def get_tensor_model_parallel_world_size(cls):
        return dist.get_world_size(group=cls._TENSOR_MODEL_PARALLEL_GROUP)

    @classmethod
    def get_tensor_model_parallel_rank(cls):
        return dist.get_rank(group=cls._TENSOR_MODEL_PARALLEL_GROUP)

    @classmethod
    def get_tensor_model_parallel_src_rank(cls):
        """Calculate the global rank corresponding to the first local rank in the tensor model
        parallel group."""
        global_rank = dist.get_rank()
        local_world_size = cls.get_tensor_model_parallel_world_size()
        return (global_rank // local_world_size) * local_world_size


def ensure_divisibility(numerator, denominator):
    assert numerator % denominator == 0, "{} is not divisible by {}".format(numerator, denominator)


def divide(numerator, denominator):
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def _check_data_types(keys, data, target_dtype):
    for key in keys:
        assert data[key].dtype == target_dtype, "{} has data type {} which is different than {}".format(
            key, data[key].dtype, target_dtype)


def _build_key_size_numel_dictionaries(keys, config):
    """Every rank knows the micro-batch shape from the config, so no size broadcast is needed."""
    key_size, key_numel, total_numel = {}, {}, 0
    for key in keys:
        size = [config.micro_batch_size, config.seq_length]
        numel = size[0] * size[1]
        key_size[key] = size
        key_numel[key] = numel
        total_numel += numel
    return key_size, key_numel, total_numel


def broadcast_data(keys, data, datatype, config):
    """Broadcast data from rank zero of each model parallel group to the members of the same
    model parallel group."""
    key_size, key_numel, total_numel = _build_key_size_numel_dictionaries(keys, config)

    # Pack on rank zero.
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        _check_data_types(keys, data, datatype)
        flatten_data = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0)
    else:
        flatten_data = torch.empty(total_numel, dtype=datatype)

    # Broadcast
    torch.distributed.broadcast(
        flatten_data,
        parallel_state.get_tensor_model_parallel_src_rank(),
        group=parallel_state.get_tensor_model_parallel_group())

    # Unpack
    output = {}
    offset = 0
    for key in keys:
        size = key_size[key]
        numel = key_numel[key]
        output[key] = flatten_data.narrow(0, offset, numel).view(size)
        offset += numel

    return output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region."""

    @staticmethod
    def forward(ctx, input_):
        group = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(group=group) == 1:
            return input_
        dist.all_reduce(input_.contiguous(), group=group)
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


class VocabUtility:
    """Split the vocabulary into `world_size` chunks and return the first and last index of the
    vocabulary belonging to the `rank` partition: Note that indices in [fist, last)"""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        index_f = rank * per_partition_vocab_size
        index_l = index_f + per_partition_vocab_size
        return index_f, index_l

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size)


class VocabParallelEmbedding(nn.Module):
    """Embedding parallelized in the vocabulary dimension."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: TransformerConfig):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        (self.vocab_start_index, self.vocab_end_index) = VocabUtility.vocab_range_from_global_vocab_size(
            self.num_embeddings, parallel_state.get_tensor_model_parallel_rank(), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, self.embedding_dim, dtype=config.params_dtype))

    def forward(self, input_):
        if self.tensor_model_parallel_size > 1:
            # Build the mask.
            input_mask = (input_ <= self.vocab_start_index) | (input_ >= self.vocab_end_index)  # BUG
            # Mask the input.
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        # Get the embeddings.
        output_parallel = F.embedding(masked_input, self.weight)
        # Mask the output embedding.
        if self.tensor_model_parallel_size > 1:
            output_parallel[input_mask, :] = 0.0
        # Reduce across all the model parallel GPUs.
        output = reduce_from_tensor_model_parallel_region(output_parallel)
        return output


class EmbeddingWithLabelScores(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        parallel_state.initialize_model_parallel(config.tensor_model_parallel_size)
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, config=config)

    def get_batch(self, tokens, labels):
        keys = ["tokens", "labels"]
        datatype = torch.int64
        # Only TP rank 0 reads the data iterator; the others get it from the broadcast.
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            data = {"tokens": tokens, "labels": labels}
        else:
            data = None
        data_b = broadcast_data(keys, data, datatype, self.config)
        return data_b["tokens"].long().contiguous(), data_b["labels"].long().contiguous()

    def forward(self, input_ids, labels):
        tokens, labels = self.get_batch(input_ids, labels)
        embeddings = self.word_embeddings(tokens)
        label_embeddings = self.word_embeddings(labels)
        label_scores = (embeddings * label_embeddings).sum(dim=-1)
        # Data format change to avoid explicit tranposes : [b s h] --> [s b h].
        embeddings = embeddings.transpose(0, 1).contiguous()
        return embeddings, label_scores


class Reference(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)

    def forward(self, input_ids, labels):
        embeddings = self.word_embeddings(input_ids)
        label_scores = (embeddings * self.word_embeddings(labels)).sum(dim=-1)
        return embeddings.transpose(0, 1).contiguous(), label_scores


def reference() -> nn.Module:
    return Reference(TransformerConfig())


def rank_module(rank: int, world_size: int) -> nn.Module:
    return EmbeddingWithLabelScores(TransformerConfig(tensor_model_parallel_size=world_size))


def inputs() -> dict[str, torch.Tensor]:
    config = TransformerConfig()
    vocab, b, s = config.padded_vocab_size, config.micro_batch_size, config.seq_length
    input_ids = torch.randint(0, vocab, (b, s))
    # the first and last id of each vocab partition
    input_ids[0, 0], input_ids[0, 1], input_ids[1, 2], input_ids[1, 3] = 0, vocab // 2 - 1, vocab // 2, vocab - 1
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = torch.tensor([vocab // 2, 0])
    return {"input_ids": input_ids, "labels": labels}


PARAM_PLACEMENTS = {"word_embeddings.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Replicate()]
