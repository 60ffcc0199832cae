"""Megatron's fused qkv / gate_up layout against HF's separate projections, and its planted bug."""
from pathlib import Path

import pytest

import scalify
from scalify.config import REPO_CONFIGS
from scalify.errors import ConfigError
from scalify.parallel import planted

from .helpers import experiment


@pytest.mark.parametrize("config", [
    experiment("llama-tiny-gqa", "llama", 2, fused=True),
    REPO_CONFIGS / "experiments" / "llama-tiny-gqa-fused-tp4.yaml",
], ids=["tp2-kv-equals-tp", "tp4-kv-replicated"])
def test_fused_layout_verifies_with_grouped_query_attention(config):
    """llama-tiny-gqa has 2 kv heads: at TP=4 each rank's qkv_proj holds a kv head it shares
    with one other rank."""
    report = scalify.verify(config, numeric=True)
    assert report.verdict == "verified", [d.hint for d in report.discrepancies]
    assert report.numeric["agrees"], report.numeric
    assert "Custom" in report.stats["rank_symmetry"]  # fused layouts take the per-rank path


@pytest.mark.parametrize("model,tp", [("llama-tiny", 2), ("llama-tiny", 4)],
                         ids=["tp2-four-groups-per-rank", "tp4-two-groups-per-rank"])
def test_fused_layout_verifies_with_several_kv_groups_per_rank(model, tp):
    """8 kv heads: each rank's qkv_proj interleaves several [q, k, v] groups, which the rank splits
    with one view; the reference's q_proj rows are a strided set of them."""
    report = scalify.verify(experiment(model, "llama", tp, fused=True), numeric=True)
    assert report.verdict == "verified", [d.hint for d in report.discrepancies]
    assert report.numeric["agrees"], report.numeric


def test_plain_column_shard_of_the_fused_weight_is_caught_at_the_shard_function_line():
    """The rank's code reads [q heads, k, v] per group, but the sharding function gave it equal
    row blocks of [q; k; v]: the first discrepancy names the sharding function's line."""
    line = next(n for n, text in enumerate(Path(planted.__file__).read_text().splitlines(), 1)
                if "# planted: fused-plain-column-shard" in text)
    report = scalify.verify(experiment("llama-tiny-gqa", "llama", 2, fused=True,
                                       bug="fused-plain-column-shard"), numeric=True)
    assert report.verdict == "discrepancy"
    assert not report.numeric["agrees"], "the bug must change the numbers"
    first = report.discrepancies[0]
    assert first.module == "model.layers.0.self_attn"
    assert f"{planted.__file__}:{line}" in first.hint
    assert any(p.startswith("model.layers.0.self_attn.q_proj.weight: Custom(0, ")
               and p.endswith(f"(declared at {planted.__file__}:{line})") for p in first.placements)


def test_fused_layout_bug_needs_the_fused_plan():
    with pytest.raises(ConfigError, match="set plan.fused: true"):
        scalify.verify(experiment("llama-tiny-gqa", "llama", 2, bug="fused-plain-column-shard"))


def test_a_shard_function_in_the_plan_states_the_relations():
    """The Megatron converter's inferred placements are plain Shards: one symbolic program."""
    report = scalify.verify(experiment(
        "llama-tiny-gqa", "llama", 2, shard_fn="scalify.parallel.sharding:shard_megatron_llama"),
        numeric=True)
    assert report.verified and report.numeric["agrees"]
    assert report.stats["rank_symmetry"] == "used"


def _training_step(config: dict) -> dict:
    return {**config, "verify": {**config["verify"], "backward": True}}


def test_fused_training_step_with_interleaved_groups_is_refused():
    """8 kv heads over 2 ranks: four interleaved groups per rank, not related yet."""
    with pytest.raises(ConfigError, match="interleaved"):
        scalify.verify(_training_step(experiment("llama-tiny", "llama", 2, fused=True)))



def test_fused_training_step_with_kv_heads_shared_by_ranks_is_refused():
    """llama-tiny-gqa over 4 ranks: each kv head replicated over two ranks, not proved yet."""
    with pytest.raises(ConfigError, match="replicated over 2 ranks"):
        scalify.verify(_training_step(experiment("llama-tiny-gqa", "llama", 4, fused=True)))
