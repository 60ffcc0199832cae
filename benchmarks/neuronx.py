"""Times the nine transformers-neuronx experiments (TP 2/4/8 x 1/2/4 layers) end to end and
writes their section of RESULTS.md beside the peer's figures; skipped without the data."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import scalify
import scalify.api  # noqa: F401  the imports (torch, transformers) are loaded before timing
from results import write_section

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "transformers-neuronx-llama"
PEER_SECONDS = {(2, 1): 10.1, (8, 2): 44.3, (8, 4): 99.4}  # Entangle on a 16-core server


def row(tp: int, layers: int) -> str:
    config = REPO / "configs" / "experiments" / f"neuron-llama-tp{tp}-layer{layers}.yaml"
    start = time.perf_counter()
    report = scalify.verify(config)
    wall = time.perf_counter() - start
    t, peer = report.timings, PEER_SECONDS.get((tp, layers))
    against = f"{peer} s ({peer / wall:.0f}x faster)" if peer else "-"
    return (f"| {tp} | {layers} | {report.verdict} | {t['capture_s']:.2f} | "
            f"{t['verify_s']:.2f} | {wall:.2f} | {against} |")


def main() -> None:
    if not DATA.is_dir():
        print(f"skipped: no transformers-neuronx data at {DATA}")
        return
    rows = []
    for tp in (2, 4, 8):
        for layers in (1, 2, 4):
            rows.append(row(tp, layers))
            print(rows[-1], flush=True)
    write_section("neuronx", "\n".join([
        "## transformers-neuronx Llama HLO (`configs/experiments/neuron-llama-tp*-layer*.yaml`)", "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} "
        "cores; each experiment verified end to end by `scalify.verify` (HLO parse and lowering "
        "count as capture; imports are loaded before timing, and the first row also pays for loading "
        "egglog's rules). The peer's "
        "figures are from its paper's 16-core server; the target is 20x faster. Command: "
        "`make bench`.", "",
        "| TP | layers | verdict | capture s | verify s | end-to-end s | peer |",
        "|---|---|---|---|---|---|---|", *rows]))


if __name__ == "__main__":
    main()
