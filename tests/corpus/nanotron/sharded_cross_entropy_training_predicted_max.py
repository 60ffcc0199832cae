"""nanotron sharded_cross_entropy training step -- BUG: the target logits picked on each vocab shard
are combined with a MAX all-reduce (copied from the logits_max line) instead of SUM; since the
shifted logits are <= 0 and non-owners contribute 0, the target logit is lost."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "nanotron"
STEP = "training"
WORLD_SIZE = 2
BUG = "The per-shard predicted (target) logits are all-reduced with ReduceOp.MAX instead of SUM, so the owner's shifted logit (<= 0) is replaced by the other shards' zeros."

VOCAB, HIDDEN, SEQ, BATCH = 48, 16, 6, 2


class ParallelContext:
    def __init__(self, tensor_parallel_size):
        ranks = torch.arange(dist.get_world_size()).reshape(1, -1, tensor_parallel_size)
        self.tp_pg = None
        for group_ranks in ranks.reshape(-1, tensor_parallel_size).tolist():
            group = dist.new_group(ranks=group_ranks)
            if dist.get_rank() in group_ranks:
                self.tp_pg = group


class DifferentiableIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableAllReduceSum.apply(grad_output, ctx.group), None


class DifferentiableAllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return DifferentiableIdentity.apply(grad_output, ctx.group), None


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sharded_logits, target, group):
        # sharded_logits: [s, b, v/tp], target: [s, b]
        logits_max = torch.max(sharded_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        sharded_logits = sharded_logits - logits_max.unsqueeze(dim=-1)

        sharded_hidden_size = sharded_logits.shape[-1]
        rank = dist.get_rank(group)
        start_index = rank * sharded_hidden_size
        end_index = start_index + sharded_hidden_size
        target_mask = (target < start_index) | (target >= end_index)
        masked_target = target.clone() - start_index
        masked_target[target_mask] = 0

        logits_2d = sharded_logits.view(-1, sharded_hidden_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.shape[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits = predicted_logits_1d.view_as(target).clone()
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits, op=dist.ReduceOp.MAX, group=group)  # BUG

        exp_logits = torch.exp(sharded_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, softmax.shape[-1])
        arange_1d = torch.arange(start=0, end=grad_2d.shape[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= (~target_mask.view(-1)).to(grad_2d.dtype)
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None


def sharded_cross_entropy(sharded_logits, target, group):
    return _ShardedCrossEntropy.apply(sharded_logits, target, group)


class TensorParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, pg):
        self.pg = pg
        self.rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
        block_size = num_embeddings // world_size
        self.min_id, self.max_id = self.rank * block_size, (self.rank + 1) * block_size
        super().__init__(block_size, embedding_dim)

    def forward(self, input_ids):
        cell_mask = (input_ids < self.min_id) | (input_ids >= self.max_id)
        input_ids = input_ids - self.min_id
        input_ids[cell_mask] = 0
        out = super().forward(input_ids)
        out = out * (~cell_mask[..., None])
        return DifferentiableAllReduceSum.apply(out, self.pg)


class LlamaHead(nn.Module):
    def __init__(self, parallel_context):
        super().__init__()
        self.tp_pg = parallel_context.tp_pg
        self.token_embedding = TensorParallelEmbedding(VOCAB, HIDDEN, pg=self.tp_pg)
        self.final_layer_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.lm_head = nn.Linear(HIDDEN, VOCAB // dist.get_world_size(self.tp_pg), bias=False)

    def forward(self, input_ids, label_ids, label_mask):
        # input_ids: [batch_size, seq_length] -> hidden_states: [seq_length, batch_size, hidden_size]
        hidden_states = self.token_embedding(input_ids.transpose(0, 1))
        hidden_states = self.final_layer_norm(hidden_states)
        sharded_logits = F.linear(DifferentiableIdentity.apply(hidden_states, self.tp_pg), self.lm_head.weight)
        loss = sharded_cross_entropy(sharded_logits, label_ids.transpose(0, 1).contiguous(),
                                     group=self.tp_pg).transpose(0, 1)
        loss = (loss * label_mask).sum(dtype=loss.dtype) / label_mask.sum()
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, HIDDEN)
        self.final_layer_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, label_ids, label_mask):
        logits = self.lm_head(self.final_layer_norm(self.token_embedding(input_ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), label_ids.flatten(), reduction="none").view_as(label_mask)
        loss = (loss * label_mask).sum() / label_mask.sum()
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return LlamaHead(ParallelContext(tensor_parallel_size=world_size))


def inputs() -> dict[str, torch.Tensor]:
    label_mask = torch.ones(BATCH, SEQ)
    label_mask[0, :2] = 0.0
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ)), "label_ids": torch.randint(0, VOCAB, (BATCH, SEQ)),
            "label_mask": label_mask}


PARAM_PLACEMENTS = {"token_embedding.weight": scalify.Shard(0), "lm_head.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(0), scalify.Replicate(), scalify.Shard(0)]
