"""Hand-written vocab-parallel language-model step: VocabParallelEmbedding (masked local lookup +
all-reduce), a replicated projection entered through a copy-to-TP autograd Function, a
vocab-sharded LM head, and a vocab-parallel cross-entropy autograd Function using functional
collectives (max / sum all-reduces) with its own backward; the batch is broadcast from rank 0."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify

STYLE = "torch_distributed"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, DIM, SEQ = 64, 16, 6


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits_max = funcol.all_reduce(logits.max(dim=-1)[0], "max", group)
        logits = logits - logits_max.unsqueeze(-1)
        partition_vocab = logits.shape[-1]
        target_mask = (target < vocab_start) | (target >= vocab_start + partition_vocab)
        masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        arange = torch.arange(logits.shape[0], device=logits.device)
        predicted = logits[arange, masked_target].masked_fill(target_mask, 0.0)
        predicted = funcol.all_reduce(predicted, "sum", group)
        exp_logits = logits.exp()
        sum_exp = funcol.all_reduce(exp_logits.sum(dim=-1), "sum", group)
        loss = torch.log(sum_exp) - predicted
        softmax = exp_logits / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad = softmax.clone()
        arange = torch.arange(grad.shape[0], device=grad.device)
        grad[arange, masked_target] -= 1.0 - target_mask.to(grad.dtype)
        return grad * grad_output.unsqueeze(-1), None, None, None


class LM(nn.Module):
    def __init__(self, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.vocab_per_rank = VOCAB // tp
        self.embed = nn.Parameter(torch.randn(self.vocab_per_rank, DIM))
        self.proj = nn.Linear(DIM, DIM)
        self.lm_head = nn.Parameter(torch.randn(self.vocab_per_rank, DIM) * 0.3)

    def forward(self, tokens, labels):
        start = self.tp_rank * self.vocab_per_rank
        if self.tp_group is None:
            h = F.embedding(tokens, self.embed)
        else:
            batch = torch.stack([tokens, labels])
            dist.broadcast(batch, src=0, group=self.tp_group)   # rank 0 owns the data loader
            tokens, labels = batch
            mask = (tokens < start) | (tokens >= start + self.vocab_per_rank)
            h = F.embedding((tokens - start).masked_fill(mask, 0), self.embed)
            h = _ReduceFromTP.apply(h.masked_fill(mask.unsqueeze(-1), 0.0), self.tp_group)
        h = torch.tanh(self.proj(h))
        if self.tp_group is None:
            logits = F.linear(h, self.lm_head)
            loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        else:
            logits = F.linear(_CopyToTP.apply(h, self.tp_group), self.lm_head)
            loss = _VocabParallelCrossEntropy.apply(logits.view(-1, self.vocab_per_rank), labels.view(-1),
                                                    start, self.tp_group).mean()
        params = [self.embed, self.proj.weight, self.proj.bias, self.lm_head]
        return (loss, *torch.autograd.grad(loss, params))


def reference() -> nn.Module:
    return LM()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return LM(tp_group=dist.new_group(list(range(world_size))))


def inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, VOCAB, (2, SEQ)), "labels": torch.randint(0, VOCAB, (2, SEQ))}


PARAM_PLACEMENTS = {"embed": scalify.Shard(0), "lm_head": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(0), scalify.Replicate(), scalify.Replicate(),
                     scalify.Shard(0)]
