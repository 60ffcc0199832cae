"""Head-parallel attention whose ranks call PyTorch's `scaled_dot_product_attention` (which
scales the query and the key by the scale's square root, adds a mask of zeros and -inf and
takes a safe softmax) against a reference written by hand (scores divided by the scale, filled
with -inf above the diagonal, a plain softmax): the same math, forward and backward, and the
other way round. A rank attending causally where the reference does not, or the other way
round, is caught. Megatron's fill of -10000 against HuggingFace's added dtype minimum verifies,
the assumption stated."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

HIDDEN, HEADS, HEAD_DIM, WORLD = 16, 4, 4, 2


class Attention(nn.Module):
    """Heads attended by hand, or through `F.scaled_dot_product_attention`; a rank's output
    projection's partial sums all-reduced."""

    def __init__(self, causal: bool, sdpa: bool, heads: int = HEADS, fill: str = "-inf") -> None:
        super().__init__()
        self.causal, self.sdpa, self.heads, self.fill = causal, sdpa, heads, fill
        self.qkv = nn.Linear(HIDDEN, 3 * heads * HEAD_DIM, bias=False)
        self.out = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)

    def attend(self, q, k, v):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        if self.causal:
            keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
            if self.fill == "dtype minimum":  # HuggingFace's additive mask
                scores = scores + torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
            else:  # -inf, or Megatron's -10000.0
                scores = scores.masked_fill(~keep, float(self.fill))
        return scores.softmax(-1) @ v

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, self.heads, HEAD_DIM).unbind(2))
        out = self.out(self.attend(q, k, v).transpose(1, 2).flatten(2))
        if self.heads < HEADS:
            dist.all_reduce(out)
        return out


def _heads(state, rank, world_size):
    qkv = state["qkv.weight"].view(3, HEADS, HEAD_DIM, HIDDEN)
    return {"qkv.weight": qkv.chunk(world_size, 1)[rank].reshape(-1, HIDDEN),
            "out.weight": state["out.weight"].chunk(world_size, 1)[rank]}


def _verify(reference_causal: bool, rank_causal: bool, grad: bool = False,
            sdpa_on_ranks: bool = True):
    return scalify.verify_modules(
        reference=Attention(reference_causal, not sdpa_on_ranks),
        rank_module_factory=lambda rank: Attention(rank_causal, sdpa_on_ranks, HEADS // WORLD),
        world_size=WORLD,
        example_inputs={"x": torch.randn(2, 8, HIDDEN)}, shard_fn=_heads,
        output_placements=[scalify.Replicate()], numeric=True, grad=grad)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_on_the_ranks_verifies_against_attention_written_by_hand(causal, grad):
    report = _verify(causal, causal, grad)
    assert report.verdict == "verified" and report.numeric["agrees"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_written_by_hand_on_the_ranks_verifies_against_sdpa(causal):
    report = _verify(causal, causal, sdpa_on_ranks=False)
    assert report.verdict == "verified" and report.numeric["agrees"]


@pytest.mark.parametrize("reference_causal", [False, True], ids=["rank-causal", "rank-full"])
def test_a_rank_masking_otherwise_than_the_reference_is_caught(reference_causal):
    report = _verify(reference_causal, not reference_causal)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]


def test_megatrons_fill_verifies_against_huggingfaces_added_minimum_and_is_stated():
    report = scalify.verify_modules(
        reference=Attention(True, False, fill="dtype minimum"),
        rank_module_factory=lambda rank: Attention(True, False, HEADS // WORLD, fill="-10000.0"),
        world_size=WORLD, example_inputs={"x": torch.randn(2, 8, HIDDEN)}, shard_fn=_heads,
        output_placements=[scalify.Replicate()], numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert "-10000 or less weighs 0" in report.stats["assumed"]["softmax fills"]
