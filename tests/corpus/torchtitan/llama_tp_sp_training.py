"""torchtitan Llama 3 Transformer (embedding, one TransformerBlock, norm, output) under tensor +
sequence parallelism with torchtitan's plan; one training step: cross-entropy loss, gradients,
replicated (norm) gradients redistributed from Partial to Replicate."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import scalify

STYLE = "torchtitan"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, DIM, N_HEADS, N_KV_HEADS, HIDDEN, SEQ = 32, 16, 4, 2, 32, 8


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end), freqs)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)   # real view of polar(1, freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = x.reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, x_.shape[1], 1, x_.shape[3], 2)
    out = torch.stack([x_[..., 0] * fc[..., 0] - x_[..., 1] * fc[..., 1],
                       x_[..., 0] * fc[..., 1] + x_[..., 1] * fc[..., 0]], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_rep = N_HEADS // N_KV_HEADS
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        xk = torch.repeat_interleave(xk, self.n_rep, dim=2)
        xv = torch.repeat_interleave(xv, self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                             xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({"0": TransformerBlock()})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // N_HEADS, SEQ), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class TrainStep(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        pred = self.model(tokens)
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        params = [p for _, p in self.model.named_parameters()]
        grads = torch.autograd.grad(loss, params)
        synced = []
        for p, g in zip(params, grads):
            if isinstance(g, DTensor):
                # e.g. norm weights under SequenceParallel get Partial grads: bring each
                # gradient to its parameter's layout before handing it to the optimizer
                g = g.redistribute(p.device_mesh, p.placements).to_local()
            synced.append(g)
        return (loss, *synced)


def apply_tp(model: Transformer, tp_mesh) -> None:
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, layer_plan)


def _load_local_shards_hook(module, state_dict, prefix, *args):
    for name, param in module.state_dict().items():
        key = prefix + name
        if isinstance(param, DTensor) and key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = DTensor.from_local(state_dict[key], param.device_mesh, param.placements,
                                                 run_check=False)


def reference() -> nn.Module:
    return TrainStep(Transformer())


def rank_module(rank: int, world_size: int) -> nn.Module:
    model = Transformer()
    apply_tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    step = TrainStep(model)
    step.register_load_state_dict_pre_hook(_load_local_shards_hook)
    return step


def inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, VOCAB, (2, SEQ)), "labels": torch.randint(0, VOCAB, (2, SEQ))}


_L = "model.layers.0."
PARAM_PLACEMENTS = {"model.tok_embeddings.weight": scalify.Shard(0), "model.output.weight": scalify.Shard(0),
                    _L + "attention.wq.weight": scalify.Shard(0), _L + "attention.wk.weight": scalify.Shard(0),
                    _L + "attention.wv.weight": scalify.Shard(0), _L + "attention.wo.weight": scalify.Shard(1),
                    _L + "feed_forward.w1.weight": scalify.Shard(0), _L + "feed_forward.w3.weight": scalify.Shard(0),
                    _L + "feed_forward.w2.weight": scalify.Shard(1)}
_NAMES = [n for n, _ in TrainStep(Transformer()).named_parameters()]
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] + [PARAM_PLACEMENTS.get(n, scalify.Replicate()) for n in _NAMES]
