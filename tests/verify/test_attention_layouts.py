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


class FusedHeads(nn.Module):
    """The reference's q, k, v and output projections, as HuggingFace's Llama attention."""

    def __init__(self) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x):
        heads = lambda t: t.view(x.shape[0], SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM ** -0.5, -1)
        return self.o(torch.matmul(probs, v).transpose(1, 2).reshape(x.shape[0], SEQ, -1))


class MegatronHeads(nn.Module):
    """Megatron-Core's attention on one rank: a fused [q, k, v] per head in `[s, b, h]`, the
    heads merged into the batch of `baddbmm` and `bmm`, the context back to `[s, b, h]` rows
    for the row-parallel output projection, all-reduced."""

    def __init__(self) -> None:
        super().__init__()
        width, local = HEADS * HEAD_DIM, HEADS // WORLD
        self.qkv = nn.Linear(width, 3 * local * HEAD_DIM, bias=False)
        self.o = nn.Linear(local * HEAD_DIM, width, bias=False)

    def forward(self, x):
        batch, local = x.shape[0], HEADS // WORLD
        mixed = torch.matmul(x.transpose(0, 1), self.qkv.weight.t())
        q, k, v = (t.reshape(SEQ, batch * local, HEAD_DIM).transpose(0, 1) for t in torch.split(
            mixed.view(SEQ, batch, local, 3 * HEAD_DIM), [HEAD_DIM] * 3, dim=3))
        scores = torch.baddbmm(torch.empty(batch * local, SEQ, SEQ), q, k.transpose(1, 2),
                               beta=0.0, alpha=1 / math.sqrt(HEAD_DIM))
        probs = torch.softmax(scores.view(batch, local, SEQ, SEQ), -1)
        context = torch.bmm(probs.view(batch * local, SEQ, SEQ), v).view(batch, local, SEQ, HEAD_DIM)
        rows = context.permute(2, 0, 1, 3).contiguous().view(SEQ, batch, local * HEAD_DIM)
        out = torch.matmul(rows, self.o.weight.t())
        torch.distributed.all_reduce(out)
        return out.transpose(0, 1)


def _per_head_qkv(state, rank, world_size):
    per_head = lambda name: state[name].view(HEADS, HEAD_DIM, -1)
    qkv = torch.cat([per_head("q.weight"), per_head("k.weight"), per_head("v.weight")], 1)
    return {"qkv.weight": qkv.chunk(world_size, 0)[rank].reshape(-1, HEADS * HEAD_DIM),
            "o.weight": state["o.weight"].chunk(world_size, 1)[rank]}


# A blocker of Megatron-Core's GPTModel (tests/frameworks/test_megatron_core.py) re-created small:
# the output projection's input, `[s, b, h]` rows on the ranks against `[b, s, h]` rows related
# batch block by batch block; its elements are numbered without multiplying out each product.
@pytest.mark.slow
def test_megatrons_attention_through_the_output_projection_verifies():
    report = scalify.verify_modules(
        reference=FusedHeads(), rank_module_factory=lambda rank: MegatronHeads(), world_size=WORLD,
        example_inputs={"x": torch.randn(2, SEQ, HEADS * HEAD_DIM)}, shard_fn=_per_head_qkv,
        numeric=True, options=VerifyOptions(rank_symmetry=False))
    assert report.numeric["agrees"]
    assert report.verdict == "verified", report.discrepancies[:1]
