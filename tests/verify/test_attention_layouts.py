"""Attention scores written in another layout verify, batch of one included: heads sharded over
the ranks, each rank's queries held `[b, s, h]` or Megatron's `[s, b, h]` and merged into the
batch of one product (`[b * h, s, d]`, as Megatron-Core's DotProductAttention does), against a
reference's four-dimensional `[b, h, s, d]` product."""
import math

import pytest
import torch
from torch import nn

import scalify
from scalify.verify.verifier import VerifyOptions

HEADS, SEQ, HEAD_DIM, WORLD = 4, 8, 8, 2


class Scores(nn.Module):
    """The reference: q k^T / sqrt(d) over [b, h, s, d]."""

    def forward(self, x):
        q = x.view(x.shape[0], SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        return torch.matmul(q, q.transpose(2, 3)) * (1 / math.sqrt(HEAD_DIM))


class RankScores(nn.Module):
    """Rank `rank`'s heads, in `layout` ("bsh" or Megatron's "sbh"), merged into the batch of a
    `baddbmm` with beta 0 on an uninitialised buffer."""

    def __init__(self, rank: int, layout: str) -> None:
        super().__init__()
        self.rank, self.layout = rank, layout

    def forward(self, x):
        batch, local = x.shape[0], HEADS // WORLD
        width = local * HEAD_DIM
        if self.layout == "sbh":
            mine = x.transpose(0, 1)[..., self.rank * width:(self.rank + 1) * width]
            q = mine.reshape(SEQ, batch, local, HEAD_DIM).reshape(SEQ, batch * local, HEAD_DIM)
            q = q.transpose(0, 1)
        else:
            mine = x[..., self.rank * width:(self.rank + 1) * width]
            q = mine.view(batch, SEQ, local, HEAD_DIM).transpose(1, 2).reshape(
                batch * local, SEQ, HEAD_DIM)
        buffer = torch.empty(batch * local, SEQ, SEQ)
        scores = torch.baddbmm(buffer, q, q.transpose(1, 2), beta=0.0, alpha=1 / math.sqrt(HEAD_DIM))
        return scores.view(batch, local, SEQ, SEQ)


# Megatron's [s, b, h] with a batch of one needs a unit dim squeezed past an inserted one and
# past its swapped neighbour: those rules grow the e-graph past a window's budget elsewhere (a
# Megatron-Core GQA corpus case then fails), so they are not in the rule set yet.
_UNIT_BATCH_SBH = pytest.mark.xfail(strict=True, reason="[s, b, h] with a batch of one: unit-dim "
                                    "rules not in the rule set yet")


@pytest.mark.parametrize("symmetric", [True, False], ids=["one-program", "per-rank"])
@pytest.mark.parametrize("layout,batch", [("bsh", 1), ("bsh", 2),
                                          pytest.param("sbh", 1, marks=_UNIT_BATCH_SBH), ("sbh", 2)])
def test_heads_merged_into_the_batch_of_a_product_verify(layout, batch, symmetric):
    report = scalify.verify_modules(
        reference=Scores(), rank_module_factory=lambda rank: RankScores(rank, layout),
        world_size=WORLD, example_inputs={"x": torch.randn(batch, SEQ, HEADS * HEAD_DIM)},
        output_placements=[scalify.Shard(1)], numeric=True,
        options=VerifyOptions(rank_symmetry=symmetric))
    assert report.verdict == "verified", report.discrepancies[:1]
    assert report.numeric["agrees"]
