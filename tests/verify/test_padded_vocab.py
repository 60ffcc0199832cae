"""A vocab-parallel embedding over a vocabulary padded to a multiple of the shard size, with
vLLM's range test (`ids >= start & ids < end`, the lookup of `mask * (ids - start)`): the last
rank's range ends at the real vocabulary, short of its padded rows. It verifies, and so does the
range tested on ids in the rank's numbering (nanotron); a range that leaves out each rank's
first id is caught at its line."""
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

VOCAB, PADDED, HIDDEN, WORLD = 10, 16, 4, 2


class Embedding(nn.Module):
    def __init__(self, rows: int = VOCAB) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, HIDDEN))

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class PaddedVocabEmbedding(Embedding):
    def __init__(self, rank: int) -> None:
        super().__init__(PADDED // WORLD)
        self.start = min(rank * PADDED // WORLD, VOCAB)
        self.end = min((rank + 1) * PADDED // WORLD, VOCAB)

    def in_range(self, ids):
        return (ids >= self.start) & (ids < self.end)

    def forward(self, ids):
        mask = self.in_range(ids)
        out = F.embedding(mask * (ids - self.start), self.weight)
        out.masked_fill_(~mask.unsqueeze(-1), 0)
        dist.all_reduce(out)
        return out


class ExclusiveStart(PaddedVocabEmbedding):
    def in_range(self, ids):
        return (ids > self.start) & (ids < self.end)  # the bug: each rank's first id is lost


def shard(state, rank, world_size):
    padded = torch.cat([state["weight"], state["weight"].new_zeros(PADDED - VOCAB, HIDDEN)])
    return {"weight": padded.chunk(world_size)[rank].clone()}


def _verify(rank_module):
    return scalify.verify_modules(
        reference=Embedding(), rank_module_factory=rank_module, world_size=WORLD,
        example_inputs={"ids": torch.randint(0, VOCAB, (3, 5))}, shard_fn=shard,
        output_placements=[scalify.Replicate()], numeric=True)


def test_a_padded_vocab_with_vllm_range_test_verifies():
    report = _verify(PaddedVocabEmbedding)
    assert report.verdict == "verified", report.summary()


def test_a_range_that_leaves_out_its_first_id_is_caught_at_its_line():
    report = _verify(ExclusiveStart)
    assert report.verdict == "discrepancy"
    line = inspect.getsourcelines(ExclusiveStart.in_range)[1] + 1
    assert (__file__, line) in report.discrepancies[0].lines()


class LocalIdsMask(PaddedVocabEmbedding):
    """nanotron's form: the ids moved into the rank's numbering first, the range tested there."""

    def forward(self, ids):
        local = ids - self.start
        mask = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(mask, 0), self.weight) * ~mask.unsqueeze(-1)
        dist.all_reduce(out)
        return out


def test_a_range_tested_on_ids_in_the_ranks_numbering_verifies():
    report = _verify(LocalIdsMask)
    assert report.verdict == "verified", report.summary()
