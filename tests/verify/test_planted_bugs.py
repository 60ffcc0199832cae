"""Every planted bug is caught, named at its planted line, and confirmed by the numbers."""
from pathlib import Path

import pytest

import scalify
from scalify.parallel import planted

from .helpers import experiment

SOURCE = Path(planted.__file__).read_text().splitlines()

CASES = [
    ("missing-allreduce", "llama-tiny", "llama", 2),
    ("global-heads-reshape", "gpt2-tiny", "gpt2", 2),
    ("bias-before-allreduce", "gpt2-tiny", "gpt2", 2),
    ("column-wrong-dim", "llama-tiny", "llama", 2),
    ("vocab-mask-off-by-one", "llama-tiny", "llama", 2),
    ("vocab-mask-off-by-one", "gpt2-tiny", "gpt2", 4),
    ("softmax-wrong-dim", "llama-tiny", "llama", 2),
    ("double-allreduce", "llama-tiny", "llama", 2),
]


def planted_line(bug: str) -> int:
    lines = [n for n, text in enumerate(SOURCE, 1) if f"# planted: {bug}" in text]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.parametrize("symmetry", [True, False], ids=["one-program", "per-rank"])
@pytest.mark.parametrize("bug,model,family,tp", CASES)
def test_planted_bug_is_caught_at_its_line(bug, model, family, tp, symmetry):
    report = scalify.verify(experiment(model, family, tp, bug=bug, rank_symmetry=symmetry),
                            numeric=True)
    assert report.stats["rank_symmetry"] == ("used" if symmetry else "off")
    assert report.verdict == "discrepancy"
    assert not report.numeric["agrees"], "the bug must change the numbers"
    first = report.discrepancies[0]
    assert (planted.__file__, planted_line(bug)) in first.lines()


def test_wrong_kv_head_mapping_is_caught_and_its_placement_shown():
    """The kv-head-of-rank mapping is data, not an op: the report shows the placement it made."""
    report = scalify.verify(experiment("llama-tiny-gqa", "llama", 4, bug="gqa-wrong-kv-head"),
                            numeric=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    first = report.discrepancies[0]
    assert first.ref_op == "matmul"
    assert any("k_proj.weight: Shard(0, chunk_of_rank=[0, 1, 0, 1])" in p for p in first.placements)
