"""DeepSpeed-Ulysses sequence parallel attention, training step; BUG: after the heads-scatter
all_to_all the received sequence chunks are interleaved token by token instead of concatenated
in rank order, so the gathered sequence is out of order."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = "The sequence-gathering all_to_all output is reshaped with the source-rank and local-sequence dims swapped, interleaving the sequence chunks."

HIDDEN, HEADS = 16, 4
HEAD_DIM = HIDDEN // HEADS


def single_all_to_all(input, scatter_idx, gather_idx, group):
    """[s, b, h, d] layouts only: scatter_idx=2/gather_idx=0 (heads out, sequence in) or back."""
    seq_world_size = dist.get_world_size(group)
    if scatter_idx == 2:
        s, b, h, d = input.shape
        # [s_local, b, P, h/P, d] -> [P, s_local, b, h/P, d]: chunk j of dim 0 goes to rank j
        input_t = input.reshape(s, b, seq_world_size, h // seq_world_size, d).permute(2, 0, 1, 3, 4).contiguous()
        output = torch.empty_like(input_t)
        dist.all_to_all_single(output, input_t, group=group)
        # chunk i came from rank i, i.e. sequence chunk i
        return output.transpose(0, 1).reshape(seq_world_size * s, b, h // seq_world_size, d)  # BUG
    s, b, h, d = input.shape
    input_t = input.reshape(seq_world_size, s // seq_world_size, b, h, d).contiguous()
    output = torch.empty_like(input_t)
    dist.all_to_all_single(output, input_t, group=group)
    # chunk i came from rank i, i.e. head group i
    return output.permute(1, 2, 0, 3, 4).reshape(s // seq_world_size, b, seq_world_size * h, d)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, scatter_idx, gather_idx):
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return single_all_to_all(input, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _SeqAllToAll.apply(ctx.group, *grad_output, ctx.gather_idx, ctx.scatter_idx), None, None)


class DistributedAttention(nn.Module):
    def __init__(self, local_attention, sequence_process_group, scatter_idx=2, gather_idx=0):
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query, key, value):
        query_layer = _SeqAllToAll.apply(self.spg, query, self.scatter_idx, self.gather_idx)
        key_layer = _SeqAllToAll.apply(self.spg, key, self.scatter_idx, self.gather_idx)
        value_layer = _SeqAllToAll.apply(self.spg, value, self.scatter_idx, self.gather_idx)
        context_layer = self.local_attn(query_layer, key_layer, value_layer)
        return _SeqAllToAll.apply(self.spg, context_layer, self.gather_idx, self.scatter_idx)


def core_attention(q, k, v):
    """[s, b, h, d] causal attention."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / HEAD_DIM ** 0.5
    s = q.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v).permute(2, 0, 1, 3)


class SelfAttention(nn.Module):
    def __init__(self, attn_fn):
        super().__init__()
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.attn_fn = attn_fn

    def forward(self, hidden_states):
        s, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(s, b, HEADS, 3 * HEAD_DIM)
        q, k, v = torch.split(mixed, HEAD_DIM, dim=-1)
        context = self.attn_fn(q, k, v)
        return self.dense(context.reshape(s, b, HIDDEN))


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = SelfAttention(core_attention)

    def forward(self, hidden_states, target):
        loss = F.mse_loss(self.attention(hidden_states), target)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class UlyssesEngine(nn.Module):
    def __init__(self):
        super().__init__()
        self.sp_group = dist.new_group(list(range(dist.get_world_size())))
        self.attention = SelfAttention(DistributedAttention(core_attention, self.sp_group))

    def forward(self, hidden_states, target):
        loss = F.mse_loss(self.attention(hidden_states), target)   # mean over the local tokens
        grads = torch.autograd.grad(loss, list(self.parameters()))
        sp_size = dist.get_world_size(self.sp_group)
        for g in grads:
            dist.all_reduce(g, group=self.sp_group)
            g.div_(sp_size)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=self.sp_group)
        return (loss / sp_size, *grads)


def reference():
    return Reference()


def rank_module(rank, world_size):
    return UlyssesEngine()


def inputs():
    return {"hidden_states": torch.randn(8, 2, HIDDEN), "target": torch.randn(8, 2, HIDDEN)}


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(0), "target": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 5
