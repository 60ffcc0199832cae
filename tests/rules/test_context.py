"""The context-parallel rules run for any program that merges attention blocks, not only for
plans that say so: ring attention written with sends and receives verifies through
`verify_modules` with default options, causal too (blocks wholly in the future skipped, the
merge started from a log-sum-exp of -inf and zeros)."""
import inspect
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


def _attention(q, k, v, causal=False):
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    if causal:
        future = torch.triu(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, -1) @ v


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

    def __init__(self, ring: bool = False, causal: bool = False, key_chunk=None) -> None:
        super().__init__()
        self.ring, self.causal = ring, causal
        self.key_chunk = key_chunk or (lambda rank, source: source)
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if not self.ring:
            y = _attention(q, k, v, self.causal)
        else:
            y = self._causal_ring(q, k, v) if self.causal else self._ring(q, k, v)
        return y.transpose(1, 2).reshape(b, s, -1)

    def _causal_ring(self, q, k, v):
        """Key blocks from later ranks skipped; masks from global positions; the merge starts
        from a log-sum-exp of -inf and an output of zeros."""
        rank, world, chunk = dist.get_rank(), dist.get_world_size(), q.shape[2]
        rows = rank * chunk + torch.arange(chunk)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"))
        for step in range(world):
            source = (rank - step) % world
            if source <= rank:
                columns = self.key_chunk(rank, source) * chunk + torch.arange(chunk)
                scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
                scores = scores.masked_fill(rows[:, None] < columns[None, :], float("-inf"))
                block_lse, block = torch.logsumexp(scores, -1), torch.softmax(scores, -1) @ v
                merged = torch.logaddexp(lse, block_lse)
                out = (out * torch.exp(lse - merged).unsqueeze(-1)
                       + block * torch.exp(block_lse - merged).unsqueeze(-1))
                lse = merged
            if step + 1 < world:
                k, v = _passed_on([k, v])
        return out

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


def _verify(world: int, batch: int = 1, **rank_options) -> scalify.Report:
    causal = rank_options.get("causal", False)
    return scalify.verify_modules(
        Attention(causal=causal), lambda rank: Attention(ring=True, **rank_options), world,
        {"x": torch.randn(batch, SEQ, HEADS * HEAD_DIM)}, input_placements={"x": scalify.Shard(1)},
        output_placements=[scalify.Shard(1)], numeric=True)


def test_ring_attention_over_sends_verifies_with_default_options():
    report = _verify(WORLD)
    assert report.verdict == "verified", report.discrepancies or report.unknown
    assert report.numeric["agrees"]


@pytest.mark.parametrize("batch", [1, 2])  # (2: each rank's rows interleave chunk and batch)
def test_causal_ring_attention_that_skips_future_blocks_verifies(batch):
    report = _verify(4, batch, causal=True)
    assert report.verdict == "verified", report.discrepancies or report.unknown
    assert report.numeric["agrees"]


def _own_chunk(rank: int, source: int) -> int:
    return rank  # every key block masked as if it were the rank's own


def test_causal_ring_attention_masking_keys_by_the_wrong_chunk_is_caught_at_its_mask():
    report = _verify(2, causal=True, key_chunk=_own_chunk)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    lines, start = inspect.getsourcelines(Attention._causal_ring)
    mask = start + next(i for i, text in enumerate(lines) if "rows[:, None] < columns" in text)
    keys = start + next(i for i, text in enumerate(lines) if "columns = self.key_chunk" in text)
    named = report.discrepancies[0].lines()
    assert {(inspect.getsourcefile(Attention), line) for line in (mask, keys)} <= named
