"""torchtitan tensor parallel with loss_parallel: vocab-sharded tok_embeddings (RowwiseParallel),
SequenceParallel norms, a SwiGLU FeedForward, output ColwiseParallel keeping logits sharded on the
vocab (Shard(-1) DTensor) and cross-entropy computed under loss_parallel(); one training step."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

import scalify

STYLE = "torchtitan"
STEP = "training"
WORLD_SIZE = 2
BUG = None

VOCAB, DIM, HIDDEN, SEQ = 64, 16, 32, 8


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TinyLM(nn.Module):
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


class TrainStep(nn.Module):
    def __init__(self, model: nn.Module, loss_parallel_enabled: bool):
        super().__init__()
        self.model = model
        self.loss_parallel_enabled = loss_parallel_enabled

    def forward(self, tokens, labels):
        params = list(self.model.parameters())
        if self.loss_parallel_enabled:
            with loss_parallel():
                pred = self.model(tokens)
                loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
                grads = torch.autograd.grad(loss, params)
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            grads = [g.redistribute(p.device_mesh, p.placements).to_local() for p, g in zip(params, grads)]
        else:
            pred = self.model(tokens)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            grads = torch.autograd.grad(loss, params)
        return (loss, *grads)


def parallelize_llama(model: TinyLM, tp_mesh) -> TinyLM:
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    return model


def _load_local_shards_hook(module, state_dict, prefix, *args):
    for name, param in module.state_dict().items():
        key = prefix + name
        if isinstance(param, DTensor) and key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = DTensor.from_local(state_dict[key], param.device_mesh, param.placements,
                                                 run_check=False)


def reference() -> nn.Module:
    return TrainStep(TinyLM(), loss_parallel_enabled=False)


def rank_module(rank: int, world_size: int) -> nn.Module:
    world_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    step = TrainStep(parallelize_llama(TinyLM(), world_mesh["tp"]), loss_parallel_enabled=True)
    step.register_load_state_dict_pre_hook(_load_local_shards_hook)
    return step


def inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, VOCAB, (2, SEQ)), "labels": torch.randint(0, VOCAB, (2, SEQ))}


PARAM_PLACEMENTS = {"model.tok_embeddings.weight": scalify.Shard(0), "model.output.weight": scalify.Shard(0),
                    "model.feed_forward.w1.weight": scalify.Shard(0),
                    "model.feed_forward.w3.weight": scalify.Shard(0),
                    "model.feed_forward.w2.weight": scalify.Shard(1)}
_NAMES = ["model.tok_embeddings.weight", "model.ffn_norm.weight", "model.feed_forward.w1.weight",
          "model.feed_forward.w2.weight", "model.feed_forward.w3.weight", "model.norm.weight",
          "model.output.weight"]
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()] + [PARAM_PLACEMENTS.get(n, scalify.Replicate()) for n in _NAMES]
