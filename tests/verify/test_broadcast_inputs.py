"""Inputs every rank holds whole, stacked and broadcast from rank 0 before use (the data loader
runs on one rank): the ranks' copies are the reference's inputs, so a vocab-parallel lookup of
the broadcast ids verifies, and a lookup with the wrong offset is caught."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

VOCAB, DIM, WORLD = 16, 4, 2


class Lookup(nn.Module):
    def __init__(self, rows: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(rows, DIM))

    def forward(self, tokens, labels):
        return F.embedding(tokens, self.embed) * labels.unsqueeze(-1)


class BroadcastLookup(Lookup):
    """Each rank holds rows `[rank * VOCAB / WORLD, ...)` of the table; `shift` moves the ids."""

    def __init__(self, rank: int, shift: int = 0) -> None:
        super().__init__(VOCAB // WORLD)
        self.start = rank * (VOCAB // WORLD) + shift

    def forward(self, tokens, labels):
        batch = torch.stack([tokens, labels])
        dist.broadcast(batch, src=0)
        tokens, labels = batch
        outside = (tokens < self.start) | (tokens >= self.start + VOCAB // WORLD)
        rows = F.embedding((tokens - self.start).masked_fill(outside, 0), self.embed)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(rows)
        return rows * labels.unsqueeze(-1)


def _verify(shift: int):
    return scalify.verify_modules(
        reference=Lookup(), rank_module_factory=lambda rank: BroadcastLookup(rank, shift),
        world_size=WORLD, example_inputs={"tokens": torch.randint(0, VOCAB, (2, 3)),
                                          "labels": torch.randint(0, VOCAB, (2, 3))},
        param_placements={"embed": scalify.Shard(0)}, output_placements=[scalify.Replicate()],
        numeric=True)


def test_ids_broadcast_with_other_inputs_verify():
    report = _verify(shift=0)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_a_wrong_offset_is_caught():
    report = _verify(shift=1)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
