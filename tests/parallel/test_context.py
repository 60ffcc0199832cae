"""Context-parallel Llama ranks: sequence chunks, ring order, and the log-sum-exp merge."""
from __future__ import annotations

import pytest
import torch

import scalify
from scalify.errors import ConfigError, ShapeError
from scalify.matrix import planted_line
from scalify.models import PRESETS, build_reference, make_hf_config
from scalify.parallel.context import SequenceLayout, context_parallel_rank, online_softmax_step
from scalify.parallel.context_planted import context_parts


def test_layout_gives_each_rank_its_chunk_and_visits_its_own_block_first():
    layout = SequenceLayout(world=4, seq=8)
    full = torch.arange(8).reshape(1, 8)
    assert layout.own(full, 1, 2).tolist() == [[4, 5]]
    assert layout.ring_order(1) == [1, 0, 3, 2]
    with pytest.raises(ShapeError, match="inputs.seq"):
        SequenceLayout(world=3, seq=8)


def test_balanced_layout_gives_each_rank_a_chunk_from_each_end():
    layout = SequenceLayout(world=2, seq=8, balanced=True)
    full = torch.arange(8).reshape(1, 8)
    assert [layout.chunks_of(rank) for rank in (0, 1)] == [[0, 3], [1, 2]]
    assert layout.own(full, 1, 0).tolist() == [[0, 1, 6, 7]]
    gathered = torch.cat([layout.own(full, 1, rank) for rank in (0, 1)], 1)
    assert layout.in_sequence_order(gathered, 1).tolist() == full.tolist()
    placement = layout.placement(1)
    assert sorted((p.ref_start, p.rank, p.local_start) for p in placement.pieces) == [
        (0, 0, 0), (2, 1, 0), (4, 1, 2), (6, 0, 2)]
    with pytest.raises(ShapeError, match="4 equal chunks"):
        SequenceLayout(world=2, seq=6, balanced=True)


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_online_softmax_over_blocks_in_any_order_is_attention_over_all_keys(order):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 2, 3, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64)
    result = None
    for block in order:
        keys = slice(2 * block, 2 * block + 2)
        result = online_softmax_step(result, scores[..., keys], values[..., keys, :])
    expected = torch.softmax(scores, -1) @ values
    torch.testing.assert_close(result[0], expected)
    torch.testing.assert_close(result[1], torch.logsumexp(scores, -1, keepdim=True))


def test_rank_model_keeps_hf_parameter_names():
    config = make_hf_config("llama", {**PRESETS["llama-tiny"].config, "num_hidden_layers": 1})
    rank = context_parallel_rank(config, 1, SequenceLayout(2, 8),
                                 lambda c: build_reference("llama", c))
    reference = dict(build_reference("llama", config).named_parameters())
    assert {n: p.shape for n, p in rank.named_parameters()} == {n: p.shape for n, p in reference.items()}
    assert config._attn_implementation == "eager"  # the reference's config is left alone


def test_unknown_planted_bug_names_the_known_ones():
    with pytest.raises(ConfigError, match="cp-local-softmax-no-merge"):
        context_parts("missing-allreduce")


def _experiment(batch: int = 1, **plan) -> dict:
    world = plan.get("context_parallel", 2) * plan.get("tensor_parallel", 1)
    return {"model": "llama-tiny", "plan": {"context_parallel": 2, **plan},
            "hardware": {"name": f"gpu-{world}", "target": "gpu", "devices": world},
            "inputs": {"batch": batch, "seq": 8}}


@pytest.mark.parametrize("balanced", [False, True])
def test_context_parallelism_verifies_for_a_batch_of_two(balanced):
    """(Batch and heads merged for the products: the values' chunks side by side are one merge.)"""
    report = scalify.verify({**_experiment(batch=2, context_load_balance=balanced),
                             "overrides": {"model.num_hidden_layers": 1}}, numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_load_balanced_context_parallelism_catches_an_unmerged_softmax():
    """The correct load-balanced plan and the mask bug are matrix cells (tests/test_matrix.py)."""
    bug = "cp-local-softmax-no-merge"
    report = scalify.verify({**_experiment(context_load_balance=True, planted_bug=bug),
                             "overrides": {"model.num_hidden_layers": 1}}, numeric=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    assert planted_line(bug) in report.discrepancies[0].lines()


@pytest.mark.parametrize("experiment, message", [
    (_experiment(tensor_parallel=2), "combined with tensor"),
    (_experiment(context_parallel=1, context_load_balance=True), "needs context parallelism"),
    ({**_experiment(), "model": "gpt2-tiny"}, "megatron-style llama"),
    ({**_experiment(), "verify": {"backward": True}}, "not supported for context-parallel"),
])
def test_unsupported_context_parallel_configs_are_refused(experiment, message):
    with pytest.raises(ConfigError, match=message):
        scalify.verify(experiment)
