"""torchtitan-style data parallel with FSDP-like sharding over a "dp" mesh: every parameter is
held as a dim-0 shard, all-gathered (all_gather_into_tensor) for the step, and the unsharded
gradients are reduce-scattered (async) and averaged over the data-parallel ranks; batch sharded."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call

import scalify

STYLE = "torchtitan"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, DIM, HIDDEN, SEQ = 32, 16, 32, 6


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward(DIM, HIDDEN)
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        h = h + self.feed_forward(self.ffn_norm(h))
        return self.output(self.norm(h))


def cross_entropy_loss(pred, labels):
    return F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Transformer()

    def forward(self, tokens, labels):
        params = dict(self.model.named_parameters())
        loss = cross_entropy_loss(self.model(tokens), labels)
        return (loss, *torch.autograd.grad(loss, list(params.values())))


class FSDPTrainStep(TrainStep):
    """fully_shard-like: parameters live as Shard(0) pieces of the dp mesh."""

    def __init__(self, dp_mesh):
        super().__init__()
        self.dp_group = dp_mesh.get_group()
        self.dp_size = dp_mesh.size()
        self.dp_rank = dp_mesh.get_local_rank()
        with torch.no_grad():
            for module in self.model.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    shard = param.chunk(self.dp_size, dim=0)[self.dp_rank].clone()
                    setattr(module, name, nn.Parameter(shard))

    def unshard(self) -> dict[str, torch.Tensor]:
        full = {}
        for name, shard in self.model.named_parameters():
            out = shard.new_empty(shard.shape[0] * self.dp_size, *shard.shape[1:])
            dist.all_gather_into_tensor(out, shard.detach().contiguous(), group=self.dp_group)
            full[name] = out.requires_grad_()
        return full

    def forward(self, tokens, labels):
        full_params = self.unshard()
        pred = functional_call(self.model, full_params, (tokens,))
        loss = cross_entropy_loss(pred, labels)
        grads = torch.autograd.grad(loss, list(full_params.values()))
        sharded_grads, works = [], []
        for grad in grads:
            out = grad.new_empty(grad.shape[0] // self.dp_size, *grad.shape[1:])
            works.append(dist.reduce_scatter_tensor(out, grad.contiguous(), group=self.dp_group,
                                                    async_op=True))
            sharded_grads.append(out)
        for work in works:
            work.wait()
        for grad in sharded_grads:
            grad.div_(self.dp_size)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=self.dp_group)
        global_loss /= self.dp_size
        return (global_loss, *sharded_grads)


def reference() -> nn.Module:
    return TrainStep()


def rank_module(rank: int, world_size: int) -> nn.Module:
    world_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return FSDPTrainStep(world_mesh["dp"])


def inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, VOCAB, (2, SEQ)), "labels": torch.randint(0, VOCAB, (2, SEQ))}


_NAMES = [n for n, _ in TrainStep().named_parameters()]
PARAM_PLACEMENTS = {name: scalify.Shard(0) for name in _NAMES}
INPUT_PLACEMENTS = {"tokens": scalify.Shard(0), "labels": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] + [scalify.Shard(0)] * len(_NAMES)
