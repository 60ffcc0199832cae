"""RESULTS.md is written in sections, each between its own markers, so that one benchmark
rewrites its section and leaves the others as they are."""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADING = "# Benchmark results\n"


def write_section(name: str, text: str, path: Path = RESULTS) -> None:
    """Put `text` between the `name` section's markers, appending the section when absent."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    current = path.read_text() if path.exists() else HEADING
    block = f"{start}\n{text.strip()}\n{end}"
    if start in current and end in current:
        before, rest = current.split(start, 1)
        current = before + block + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + f"\n\n{block}\n"
    path.write_text(current)
