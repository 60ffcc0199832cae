"""A user-written ParallelStyle for a vocab-parallel token embedding, applied with
parallelize_module: the weight is split along the vocab (Shard(0)) as a local parameter,
out-of-range token ids are masked in a forward pre-hook, and the masked local lookup is declared
Partial and redistributed to Replicate in a forward hook. Then position embedding + LayerNorm.
BUG: the upper bound of the mask is the local vocab size, not vocab_end_index."""
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

import scalify

STYLE = "dtensor"
STEP = "forward"
WORLD_SIZE = 2
BUG = "The out-of-range mask compares ids with the local partition size instead of the shard's global vocab end, so rank 1 masks all its own tokens."

VOCAB, DIM, SEQ = 48, 16, 8


class VocabParallelEmbeddingStyle(ParallelStyle):
    """Like RowwiseParallel for nn.Embedding, but keeps plain local shards."""

    def _partition(self, module: nn.Embedding, device_mesh) -> None:
        rank, world = device_mesh.get_local_rank(), device_mesh.size()
        per_rank = module.num_embeddings // world
        module.vocab_start_index = rank * per_rank
        module.vocab_end_index = module.vocab_start_index + per_rank
        module.num_embeddings_per_partition = per_rank
        module.weight = nn.Parameter(module.weight.detach()[module.vocab_start_index:module.vocab_end_index].clone())

    @staticmethod
    def _prepare_input(module, args):
        (input_ids,) = args
        input_mask = (input_ids < module.vocab_start_index) | (input_ids >= module.num_embeddings_per_partition)  # BUG
        local_ids = input_ids - module.vocab_start_index
        local_ids = local_ids.masked_fill(input_mask, 0)
        module._input_mask = input_mask
        return (local_ids,)

    @staticmethod
    def _prepare_output(device_mesh):
        def hook(module, args, output):
            output = output.masked_fill(module._input_mask.unsqueeze(-1), 0.0)
            partial = DTensor.from_local(output, device_mesh, [Partial()])
            return partial.redistribute(device_mesh, [Replicate()]).to_local()
        return hook

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._partition(module, device_mesh)
        module.register_forward_pre_hook(self._prepare_input)
        module.register_forward_hook(self._prepare_output(device_mesh))
        return module


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.ln = nn.LayerNorm(DIM)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.ln(self.wte(input_ids) + self.wpe(positions).unsqueeze(0))


def reference() -> nn.Module:
    return Embeddings()


def rank_module(rank: int, world_size: int) -> nn.Module:
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return parallelize_module(Embeddings(), tp_mesh, {"wte": VocabParallelEmbeddingStyle()})


def inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ))}


PARAM_PLACEMENTS = {"wte.weight": scalify.Shard(0)}
INPUT_PLACEMENTS = {}
OUTPUT_PLACEMENTS = [scalify.Replicate()]
