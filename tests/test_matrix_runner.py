"""The matrices' runner: one cell's error is that cell's failure, not the run's."""
from dataclasses import dataclass

from scalify.matrix import Outcome, run_all


@dataclass(frozen=True)
class _Cell:
    name: str


def _run(cell: _Cell) -> Outcome:
    if cell.name == "broken":
        raise ValueError("an assumed range needs low <= high")
    return Outcome("verified", True, None, 0.1, True)


def test_a_cell_that_raises_is_a_crash_and_the_others_still_run():
    cells = [_Cell("fine"), _Cell("broken"), _Cell("also fine")]
    outcomes = run_all(cells, _run, 2)
    assert outcomes[cells[1]] == Outcome("crash", False, None, 0.0, False,
                                         "ValueError: an assumed range needs low <= high")
    assert outcomes[cells[0]].passed and outcomes[cells[2]].passed
