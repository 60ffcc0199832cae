"""A 3-stage pipeline (one stage per rank) of an embedding + residual MLP stack with
dist.send/dist.recv between neighbouring stages; the embedding output is a long skip connection
used by the last stage, relayed hop by hop (stage 1 forwards the tensor it received from stage 0
to stage 2 unchanged). The last stage broadcasts the model output to every rank."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "torch_distributed"
STEP = "forward"
WORLD_SIZE = 3
BUG = None

VOCAB, HIDDEN, FFN, OUT, BATCH, SEQ = 32, 8, 16, 6, 2, 4
NUM_LAYERS = 3
STAGE_LAYERS = {0: [0], 1: [1], 2: [2]}     # decoder block index per stage


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, OUT)

    def forward(self, x, skip):
        return self.proj(self.norm(x + skip))


class Model(nn.Module):
    """The single-device model."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.head = Head()

    def forward(self, input_ids):
        skip = self.embed(input_ids)
        x = skip
        for layer in self.layers:
            x = layer(x)
        return self.head(x, skip)


class PipelineStage(nn.Module):
    """Stage `stage` of the model: only its own submodules exist on this rank."""

    def __init__(self, stage, num_stages):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block() for i in STAGE_LAYERS[stage]})
        if self.is_last:
            self.head = Head()

    def _recv(self):
        buffer = torch.empty(BATCH, SEQ, HIDDEN)
        dist.recv(buffer, src=self.stage - 1)
        return buffer

    def forward(self, input_ids):
        if self.is_first:
            hidden = self.embed(input_ids)
            skip = hidden
        else:
            hidden = self._recv()
            skip = self._recv()
        for layer in self.layers.values():
            hidden = layer(hidden)
        if not self.is_last:
            dist.send(hidden.contiguous(), dst=self.stage + 1)
            dist.send(skip.contiguous(), dst=self.stage + 1)
            output = torch.empty(BATCH, SEQ, OUT)
        else:
            output = self.head(hidden, skip)
        dist.broadcast(output, src=self.num_stages - 1)
        return output


def reference():
    return Model()


def rank_module(rank, world_size):
    return PipelineStage(rank, world_size)


def shard(state, rank, world_size):
    """Each stage loads only the reference parameters of the modules it holds."""
    keep = [f"layers.{i}." for i in STAGE_LAYERS[rank]]
    if rank == 0:
        keep.append("embed.")
    if rank == world_size - 1:
        keep.append("head.")
    return {name: t.clone() for name, t in state.items() if any(name.startswith(p) for p in keep)}


def inputs():
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}


INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
