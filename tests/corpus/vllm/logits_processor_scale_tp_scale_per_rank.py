"""vLLM-style ParallelLMHead + LogitsProcessor(vocab_size, org_vocab_size, scale) on 2 TP ranks;
BUG: the model divides the logit scale it hands the LogitsProcessor by the TP size, as if the
gathered logits were a sum over ranks, so every logit comes out scaled by 1/tp_size too much."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "vllm"
STEP = "forward"
WORLD_SIZE = 2
BUG = "The model computes the LogitsProcessor scale as logit_scale / (mup_width_multiplier * tp_size), a per-rank quantity, so the gathered logits are scaled by an extra 1/tp_size."

NUM_TOKENS, DEFAULT_VOCAB_PADDING_SIZE = 6, 64


class Config:
    """The bits of a HF config the model reads."""
    vocab_size = 40
    hidden_size = 12
    logit_scale = 0.5
    mup_width_multiplier = 2.0


# ---- vllm.distributed (imitation) ----
def get_tensor_model_parallel_rank():
    return dist.get_rank()


def get_tensor_model_parallel_world_size():
    return dist.get_world_size()


def tensor_model_parallel_all_gather(input_, dim=-1):
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    tensor_list = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(tensor_list, input_.contiguous())
    return torch.cat(tensor_list, dim=dim)


# ---- vllm.model_executor.layers.vocab_parallel_embedding (imitation) ----
def pad_vocab_size(vocab_size, pad_to=DEFAULT_VOCAB_PADDING_SIZE):
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def divide(numerator, denominator):
    assert numerator % denominator == 0
    return numerator // denominator


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, org_num_embeddings=None,
                 padding_size=DEFAULT_VOCAB_PADDING_SIZE):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.org_vocab_size = org_num_embeddings or num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, input_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")


# ---- vllm.model_executor.layers.logits_processor (imitation) ----
class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size, org_vocab_size=None, scale=1.0, soft_cap=None):
        super().__init__()
        self.scale = scale
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.soft_cap = soft_cap

    def _get_logits(self, hidden_states, lm_head):
        logits = F.linear(hidden_states, lm_head.weight)
        logits = tensor_model_parallel_all_gather(logits)
        if logits is not None:
            logits = logits[..., :self.org_vocab_size]
        return logits

    def forward(self, lm_head, hidden_states):
        logits = self._get_logits(hidden_states, lm_head)
        if logits is not None:
            if self.soft_cap is not None:
                logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
            if self.scale != 1.0:
                logits *= self.scale
        return logits


class ForCausalLMHead(nn.Module):
    """The lm-head half of a *ForCausalLM model (what compute_logits uses)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.unpadded_vocab_size = config.vocab_size
        self.lm_head = ParallelLMHead(self.unpadded_vocab_size, config.hidden_size,
                                      org_num_embeddings=config.vocab_size)
        logit_scale = getattr(config, "logit_scale", 1.0)
        if getattr(config, "mup_width_multiplier", None) is not None:
            logit_scale /= config.mup_width_multiplier * get_tensor_model_parallel_world_size()  # BUG
        self.logits_processor = LogitsProcessor(self.unpadded_vocab_size, config.vocab_size,
                                                logit_scale)

    @torch.inference_mode()
    def forward(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)


class ReferenceHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.scale = config.logit_scale / config.mup_width_multiplier

    def forward(self, hidden_states):
        return self.lm_head(hidden_states) * self.scale


def reference():
    return ReferenceHead(Config())


def rank_module(rank, world_size):
    return ForCausalLMHead(Config())


def shard(state, rank, world_size):
    """weight_loader: pad the vocab rows with zeros to a multiple of 64, keep this rank's rows."""
    weight = state["lm_head.weight"]
    padded = weight.new_zeros(pad_vocab_size(weight.shape[0]), weight.shape[1])
    padded[:weight.shape[0]] = weight
    return {"lm_head.weight": padded.chunk(world_size, 0)[rank].clone()}


def inputs():
    return {"hidden_states": torch.randn(NUM_TOKENS, Config.hidden_size)}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
