"""vLLM VocabParallelEmbedding -> RMSNorm -> ParallelLMHead with gathered logits; BUG: the
embedding's id mask uses the local range [0, num_embeddings_per_partition) instead of the
rank's global vocab range."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = "VocabParallelEmbedding masks token ids against the local range [0, num_embeddings_per_partition) instead of this rank's global vocab range."

VOCAB, HIDDEN, PAD_TO, EPS = 40, 16, 64, 1e-6


def get_tensor_model_parallel_rank():
    return dist.get_rank()


def get_tensor_model_parallel_world_size():
    return dist.get_world_size()


def tensor_model_parallel_all_reduce(input_):
    dist.all_reduce(input_, op=dist.ReduceOp.SUM)
    return input_


def tensor_model_parallel_all_gather(input_, dim=-1):
    world_size = get_tensor_model_parallel_world_size()
    dim = dim + input_.dim() if dim < 0 else dim
    input_size = input_.size()
    output_tensor = torch.empty((input_size[0] * world_size,) + input_size[1:],
                                dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output_tensor, input_.contiguous())
    output_tensor = output_tensor.reshape((world_size,) + input_size).movedim(0, dim)
    return output_tensor.reshape(input_size[:dim] + (world_size * input_size[dim],) + input_size[dim + 1:])


def pad_vocab_size(vocab_size, pad_to=PAD_TO):
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def vocab_range_from_global_vocab_size(global_vocab_size, rank, world_size):
    per_partition = global_vocab_size // world_size
    return rank * per_partition, (rank + 1) * per_partition


def get_masked_input_and_mask(input_, org_vocab_start_index, org_vocab_end_index):
    org_vocab_mask = (input_ >= org_vocab_start_index) & (input_ < org_vocab_end_index)
    masked_input = org_vocab_mask * (input_ - org_vocab_start_index)
    return masked_input, ~org_vocab_mask


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings)
        start, end = vocab_range_from_global_vocab_size(self.num_embeddings_padded, self.tp_rank, self.tp_size)
        self.org_vocab_start_index = min(start, num_embeddings)
        self.org_vocab_end_index = min(end, num_embeddings)
        self.num_embeddings_per_partition = end - start
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))

    def forward(self, input_):
        if self.tp_size > 1:
            masked_input, input_mask = get_masked_input_and_mask(input_, 0, self.num_embeddings_per_partition)  # BUG
        else:
            masked_input, input_mask = input_, None
        output_parallel = F.embedding(masked_input.long(), self.weight)
        if self.tp_size > 1:
            output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output_parallel)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, input_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size, org_vocab_size=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size

    def forward(self, lm_head, hidden_states):
        logits = F.linear(hidden_states, lm_head.weight)
        logits = tensor_model_parallel_all_gather(logits)
        return logits[..., :self.org_vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.variance_epsilon) * self.weight


class RankModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN)
        self.logits_processor = LogitsProcessor(VOCAB)

    @torch.inference_mode()  # the vLLM model runner executes the model in inference mode
    def forward(self, input_ids):
        hidden_states = self.norm(self.embed_tokens(input_ids))
        return self.logits_processor(self.lm_head, hidden_states)


class ReferenceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.norm(self.embed_tokens(input_ids)))


def reference():
    return ReferenceModel()


def rank_module(rank, world_size):
    return RankModel()


def shard(state, rank, world_size):
    """weight_loader: pad the vocab rows to a multiple of 64 with zeros, keep this rank's rows."""
    def vocab_shard(weight):
        padded = weight.new_zeros(pad_vocab_size(weight.shape[0]), weight.shape[1])
        padded[:weight.shape[0]] = weight
        return padded.chunk(world_size, 0)[rank].clone()
    return {"embed_tokens.weight": vocab_shard(state["embed_tokens.weight"]),
            "norm.weight": state["norm.weight"].clone(),
            "lm_head.weight": vocab_shard(state["lm_head.weight"])}


def inputs():
    return {"input_ids": torch.randint(0, VOCAB, (8,))}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
