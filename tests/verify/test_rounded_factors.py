"""Attention scores scaled as HuggingFace writes it (`head_dim ** -0.5`) and as Megatron-Core
does (`1 / math.sqrt(head_dim)`, inside `baddbmm`): the floats differ in the last bit, the math
does not, so head-parallel ranks verify and the report says which factor was taken as which.
A rank scaling by 1/head_dim is still caught."""
import math

import torch
from torch import nn

import scalify

HEADS, SEQ, HEAD_DIM, WORLD = 4, 6, 8, 2


class Scores(nn.Module):
    def forward(self, x):
        q = x.view(x.shape[0], SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        return torch.softmax(torch.matmul(q, q.transpose(2, 3)) * HEAD_DIM ** -0.5, -1)


class RankScores(nn.Module):
    def __init__(self, rank: int, factor: float) -> None:
        super().__init__()
        self.rank, self.factor = rank, factor

    def forward(self, x):
        local = HEADS // WORLD
        mine = x[..., self.rank * local * HEAD_DIM:(self.rank + 1) * local * HEAD_DIM]
        q = mine.view(x.shape[0], SEQ, local, HEAD_DIM).transpose(1, 2).reshape(-1, SEQ, HEAD_DIM)
        scores = torch.baddbmm(torch.empty(q.shape[0], SEQ, SEQ), q, q.transpose(1, 2), beta=0.0,
                               alpha=self.factor)
        return torch.softmax(scores.view(x.shape[0], local, SEQ, SEQ), -1)


def _verify(factor: float):
    return scalify.verify_modules(
        reference=Scores(), rank_module_factory=lambda rank: RankScores(rank, factor),
        world_size=WORLD, example_inputs={"x": torch.randn(2, SEQ, HEADS * HEAD_DIM)},
        output_placements=[scalify.Shard(1)], numeric=True)


def test_the_same_scale_rounded_otherwise_verifies_and_is_stated():
    assert 1 / math.sqrt(HEAD_DIM) != HEAD_DIM ** -0.5
    report = _verify(1 / math.sqrt(HEAD_DIM))
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert "test_rounded_factors.py" in report.stats["assumed"]["scalar factors"]


def test_a_rank_scaling_by_the_head_dim_is_caught():
    report = _verify(1 / HEAD_DIM)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
