"""The parallelism matrix: each cell gives the verdict it expects, numbers agreeing. Its cells
are marked `matrix` (minutes in all): `make matrix` runs them, as CI does."""
import pytest

from scalify.matrix import CELLS, SLOW, planted_line, run_cell


@pytest.mark.matrix
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
