"""A vocab-parallel embedding written torchtitan's way (its ids shifted and clamped into the
rank's rows, the lookup times its in-range mask cast then broadcast, then all-reduced)
verifies against `nn.Embedding`; with the mask left out, the rows of other ranks' ids are
added in, and it is a discrepancy."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

WORLD, VOCAB, DIM = 2, 16, 4


class ClampedEmbedding(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB // WORLD, DIM))
        self.masked = masked

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids, rows = input, self.weight.shape[0]
        offset = dist.get_rank() * rows
        mask = (ids >= offset) & (ids < offset + rows)
        out = F.embedding((ids - offset).clamp(0, rows - 1), self.weight)
        if self.masked:
            out = out * mask.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out)
        return out


def _verify(masked: bool) -> scalify.Report:
    return scalify.verify_modules(
        reference=nn.Embedding(VOCAB, DIM), world_size=WORLD,
        rank_module_factory=lambda rank: ClampedEmbedding(masked),
        example_inputs={"input": torch.randint(0, VOCAB, (2, 5))},
        param_placements={"weight": scalify.Shard(0)}, output_placements=[scalify.Replicate()],
        numeric=True, assume={"input": (0, VOCAB - 1)})


def test_a_clamped_masked_lookup_verifies():
    report = _verify(masked=True)
    assert report.verified and report.numeric["agrees"]


def test_a_clamped_lookup_without_its_mask_is_a_discrepancy():
    report = _verify(masked=False)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
