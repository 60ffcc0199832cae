"""`make bench`'s pieces still run against the current API (a renamed helper once broke it
unnoticed): the capture-speed row, on one layer."""
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_capture_speed_row_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("run", None)
    import run

    row = run.capture_speed(layers=1)
    assert row.startswith("| Llama-3.1-8B reference, 1 layers |") and row.endswith("x |")
