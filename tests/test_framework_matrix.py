"""The framework matrix: every cell of the real Megatron-Core and torchtitan gives the verdict
it expects, the numbers agreeing on a correct cell and differing on a bug, which is caught at
its line. Marked `matrix` (minutes): `make frameworks` runs them, as CI does."""
import pytest

from scalify.config import REPO_CONFIGS
from scalify.framework_matrix import CELLS, run_cell


def test_every_cell_names_an_experiment_and_every_bug_a_line():
    for cell in CELLS:
        assert (REPO_CONFIGS / "experiments" / f"{cell.config}.yaml").is_file(), cell.config
        assert bool(cell.bug) == bool(cell.file and cell.line), cell.name
    assert len({cell.name for cell in CELLS}) == len(CELLS)


@pytest.mark.matrix
@pytest.mark.parametrize("cell", CELLS, ids=[cell.name for cell in CELLS])
def test_cell(cell):
    outcome = run_cell(cell)
    expected = f"caught at {cell.file}:{cell.line}" if cell.bug else "verified"
    assert outcome.passed, f"expected {expected}, got {outcome.verdict} at {outcome.where}"
