"""vLLM-style VocabParallelEmbedding at TP=2 (torch.where masks); its shard bound is off by one."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import Parameter

import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = ("The shard check uses input_ <= end, so the id equal to end is also looked up (clamped "
       "to the last local row) on the lower rank and summed into the output.")

VOCAB_SIZE = 16
HIDDEN_SIZE = 8


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank()


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_)
    return input_


def get_masked_input_and_mask(input_: torch.Tensor, org_vocab_start_index: int,
                              org_vocab_end_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_mask = (input_ >= org_vocab_start_index) & (input_ <= org_vocab_end_index)  # BUG
    masked_input = torch.where(vocab_mask, input_ - org_vocab_start_index, 0)
    return masked_input, vocab_mask


class UnquantizedEmbeddingMethod:
    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        # bounds-safe lookup: ids are clamped into the local table
        input_ = input_.clamp(0, layer.num_embeddings_per_partition - 1)
        return F.embedding(input_, layer.weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = num_embeddings // self.tp_size
        self.org_vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.org_vocab_end_index = self.org_vocab_start_index + self.num_embeddings_per_partition
        self.quant_method = UnquantizedEmbeddingMethod()
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition,
                                            self.embedding_dim))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        input_ = input
        if self.tp_size > 1:
            masked_input, input_mask = get_masked_input_and_mask(
                input_, self.org_vocab_start_index, self.org_vocab_end_index)
        else:
            masked_input, input_mask = input_, None
        output_parallel = self.quant_method.embedding(self, masked_input.long())
        if self.tp_size > 1:
            output_parallel = torch.where(input_mask.unsqueeze(-1), output_parallel, 0.0)
        output = tensor_model_parallel_all_reduce(output_parallel)
        return output


def reference() -> nn.Module:
    return nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)


def rank_module(rank: int, world_size: int) -> nn.Module:
    return VocabParallelEmbedding(VOCAB_SIZE, HIDDEN_SIZE)


def inputs() -> dict[str, torch.Tensor]:
    return {"input": torch.tensor([[0, 3, 7, 8, 12, 15],
                                   [8, 1, 9, 14, 6, 8]], dtype=torch.long)}


PARAM_PLACEMENTS = {"weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
