"""Megatron-LM (mpu) Embedding: VocabParallelEmbedding (out-of-range ids masked, partial
lookups all-reduced) plus learned position embeddings, transposed to [s, b, h]."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_lm"
STEP = "forward"
WORLD_SIZE = 2
BUG = None

VOCAB, HIDDEN, MAX_POS, SEQ = 64, 16, 8, 8

_TENSOR_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size_=1):
    global _TENSOR_MODEL_PARALLEL_GROUP
    rank = dist.get_rank()
    for i in range(dist.get_world_size() // tensor_model_parallel_size_):
        ranks = list(range(i * tensor_model_parallel_size_, (i + 1) * tensor_model_parallel_size_))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = group


def get_tensor_model_parallel_group():
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_world_size():
    return dist.get_world_size(group=_TENSOR_MODEL_PARALLEL_GROUP)


def get_tensor_model_parallel_rank():
    return dist.get_rank(group=_TENSOR_MODEL_PARALLEL_GROUP)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        dist.all_reduce(input_, group=get_tensor_model_parallel_group())
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


class VocabUtility:
    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
        index_f = rank * per_partition_vocab_size
        index_l = index_f + per_partition_vocab_size
        return index_f, index_l

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
        per_partition_vocab_size = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition_vocab_size, rank, world_size)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tensor_model_parallel_size = get_tensor_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = \
            VocabUtility.vocab_range_from_global_vocab_size(
                self.num_embeddings, get_tensor_model_parallel_rank(), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, input_):
        if self.tensor_model_parallel_size > 1:
            # Build the mask.
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            # Mask the input.
            masked_input = input_.clone() - self.vocab_start_index
            masked_input[input_mask] = 0
        else:
            masked_input = input_
        output_parallel = F.embedding(masked_input, self.weight)
        if self.tensor_model_parallel_size > 1:
            output_parallel[input_mask, :] = 0.0
        output = reduce_from_tensor_model_parallel_region(output_parallel)
        return output


class Embedding(nn.Module):
    def __init__(self, hidden_size=HIDDEN, vocab_size=VOCAB, max_sequence_length=MAX_POS):
        super().__init__()
        initialize_model_parallel(dist.get_world_size())
        self.word_embeddings = VocabParallelEmbedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_sequence_length, hidden_size)

    def forward(self, input_ids, position_ids):
        words_embeddings = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        embeddings = words_embeddings + position_embeddings
        # Data format change to avoid explicit tranposes : [b s h] --> [s b h].
        embeddings = embeddings.transpose(0, 1).contiguous()
        return embeddings


class ReferenceEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN)

    def forward(self, input_ids, position_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return x.transpose(0, 1).contiguous()


def reference() -> nn.Module:
    return ReferenceEmbedding()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return Embedding()


def inputs() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB, (2, SEQ))
    input_ids[0, 0], input_ids[1, 3] = 0, VOCAB // 2   # first id of each vocab shard
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ).contiguous()
    return {"input_ids": input_ids, "position_ids": position_ids}


PARAM_PLACEMENTS = {"word_embeddings.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
