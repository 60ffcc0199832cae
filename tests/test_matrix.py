"""The parallelism matrix: each cell gives the verdict it expects, numbers agreeing."""
import pytest

from scalify.matrix import CELLS, planted_line, run_cell


# Cells of minutes each, and the per-rank twins of training cells whose symmetric path
# `make test` runs (the per-rank path stays in it through test_correct_configs and the EP2
# forward cell): `make test-slow` runs them, so `make test` stays short.
SLOW = {"llama/TP2 fused, 2 kv heads/backward/correct",
        "llama/TP2 fused, 2 kv heads/backward/bug fused-plain-column-shard",
        "llama/TP2/backward/per-rank", "gpt2/TP2/backward/per-rank",
        "llama/DP2 x2 micro-batches/backward/per-rank"}


@pytest.mark.parametrize("cell", [pytest.param(cell, marks=[pytest.mark.slow] * (cell.name in SLOW))
                                  for cell in CELLS], ids=[cell.name for cell in CELLS])
def test_cell(cell):
    outcome = run_cell(cell)
    if cell.bug:
        assert outcome.verdict == "discrepancy" and not outcome.agrees
        assert outcome.at_planted_line, f"reported at {outcome.where}, planted at {planted_line(cell.bug)}"
    else:
        assert outcome.verdict == "verified" and outcome.agrees


def test_every_planted_bug_of_the_new_plans_has_a_cell():
    covered = {cell.bug for cell in CELLS}
    assert {"sp-norm-grad-unreduced", "sp-gather-grad-not-reduced", "dp-mean-of-means",
            "dp-grads-averaged", "ce-target-mask-off-by-one", "ce-max-not-allreduced",
            "ce-sum-not-allreduced", "ce-loss-scaled-by-tp", "pp-stage-boundary-duplicated",
            "pp-loss-normalised-per-microbatch", "ce-sum-grad-allreduced",
            "ep-a2a-token-grad-unreduced", "sp-reduce-scatter-as-allreduce", "sp-norm-wrong-shard",
            "dp-last-microbatch-unsynced"} <= covered
