"""The context-parallel rules run for any program that merges attention blocks, not only for
plans that say so: ring attention written with sends and receives verifies through
`verify_modules` with default options."""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import scalify
from scalify.ir.graph import Graph, Node
from scalify.rules.context import needed

WORLD, HEADS, HEAD_DIM, SEQ = 2, 2, 4, 8


def _graph(*ops: str) -> Graph:
    graph = Graph()
    graph.add(Node("x", "placeholder", (), (), (2, 3), "float32"))
    for i, op in enumerate(ops):
        graph.add(Node(f"n{i}", op, ("x",), (), (2, 1), "float32"))
    return graph


@pytest.mark.parametrize("reference, ranks, wanted", [
    ((), ("logaddexp",), True),
    (("softmax",), ("logsumexp",), True),
    (("logsumexp",), ("logsumexp",), False),  # a loss both compute
    (("softmax",), ("softmax",), False),
])
def test_needed_when_ranks_merge_log_sum_exps(reference, ranks, wanted):
    assert needed(_graph(*reference), [_graph(*ranks)]) is wanted


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), -1) @ v


def _passed_on(tensors):
    rank, world = dist.get_rank(), dist.get_world_size()
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, (rank - 1) % world) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class Attention(nn.Module):
    """Projections replicated; [batch, heads, seq, head_dim] attention over the whole sequence,
    or with `ring`, over the rank's chunk with key blocks passed around a ring."""

    def __init__(self, ring: bool = False) -> None:
        super().__init__()
        self.ring = ring
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = self._ring(q, k, v) if self.ring else _attention(q, k, v)
        return y.transpose(1, 2).reshape(b, s, -1)

    @staticmethod
    def _ring(q, k, v):
        out = lse = None
        for step in range(dist.get_world_size()):
            scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
            block_lse, block = torch.logsumexp(scores, -1), torch.softmax(scores, -1) @ v
            if out is None:
                out, lse = block, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = (out * torch.exp(lse - merged).unsqueeze(-1)
                       + block * torch.exp(block_lse - merged).unsqueeze(-1))
                lse = merged
            if step + 1 < dist.get_world_size():
                k, v = _passed_on([k, v])
        return out


def test_ring_attention_over_sends_verifies_with_default_options():
    report = scalify.verify_modules(
        Attention(), lambda rank: Attention(ring=True), WORLD,
        {"x": torch.randn(1, SEQ, HEADS * HEAD_DIM)}, input_placements={"x": scalify.Shard(1)},
        output_placements=[scalify.Shard(1)], numeric=True)
    assert report.verdict == "verified", report.discrepancies or report.unknown
    assert report.numeric["agrees"]
