"""fairscale model parallel language-model ends, training step: ParallelEmbedding (embedding dim
sharded, gather_from_model_parallel_region = dist.all_gather into a list + torch.cat on the last
dim), a replicated RMSNorm, ColumnParallelLinear(gather_output=True) output head, cross-entropy;
returns the loss and the gradients of the (sharded) embedding, norm and head weights."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "fairscale"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, DIM = 32, 16

_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(model_parallel_size):
    global _MODEL_PARALLEL_GROUP
    _MODEL_PARALLEL_GROUP = dist.new_group(list(range(model_parallel_size)))


def get_model_parallel_group():
    return _MODEL_PARALLEL_GROUP


def get_model_parallel_world_size():
    return dist.get_world_size(group=get_model_parallel_group())


def get_model_parallel_rank():
    return dist.get_rank(group=get_model_parallel_group())


def _reduce(input_):
    dist.all_reduce(input_, group=get_model_parallel_group())
    return input_


def _split(input_):
    world_size = get_model_parallel_world_size()
    last_dim = input_.dim() - 1
    input_list = torch.split(input_, input_.size(last_dim) // world_size, dim=last_dim)
    return input_list[get_model_parallel_rank()].contiguous()


def _gather(input_):
    group, last_dim = get_model_parallel_group(), input_.dim() - 1
    tensor_list = [torch.empty_like(input_) for _ in range(get_model_parallel_world_size())]
    tensor_list[get_model_parallel_rank()] = input_
    dist.all_gather(tensor_list, input_, group=group)
    return torch.cat(tensor_list, dim=last_dim).contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split(grad_output)


def copy_to_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_):
    return _GatherFromModelParallelRegion.apply(input_)


class ParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, init_method=lambda x: x):
        super().__init__()
        self.embedding_dim_per_partition = embedding_dim // get_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.embedding_dim_per_partition))

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = F.embedding(input_parallel, self.weight)
        return gather_from_model_parallel_region(output_parallel)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, gather_output=True, init_method=lambda x: x):
        super().__init__()
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(out_features // get_model_parallel_world_size(), in_features))

    def forward(self, input_):
        input_parallel = copy_to_model_parallel_region(input_)
        output_parallel = F.linear(input_parallel, self.weight)
        return gather_from_model_parallel_region(output_parallel) if self.gather_output else output_parallel


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TinyLM(nn.Module):
    def __init__(self, parallel):
        super().__init__()
        self.parallel = parallel
        if parallel:
            self.tok_embeddings = ParallelEmbedding(VOCAB, DIM)
            self.output = ColumnParallelLinear(DIM, VOCAB, bias=False, gather_output=True)
        else:
            self.tok_embeddings = nn.Embedding(VOCAB, DIM)
            self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.norm = RMSNorm(DIM)

    def forward(self, tokens, targets):
        logits = self.output(self.norm(self.tok_embeddings(tokens)))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        params = [self.tok_embeddings.weight, self.norm.weight, self.output.weight]
        grads = torch.autograd.grad(loss, params)
        return (loss, *grads)


def reference():
    return TinyLM(parallel=False)


def rank_module(rank, world_size):
    initialize_model_parallel(world_size)
    return TinyLM(parallel=True)


def inputs():
    return {"tokens": torch.randint(0, VOCAB, (2, 6)), "targets": torch.randint(0, VOCAB, (2, 6))}


PARAM_PLACEMENTS = {"tok_embeddings.weight": scalify.Shard(1), "output.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(1), scalify.Replicate(), scalify.Shard(0)]
