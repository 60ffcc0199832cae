"""End-to-end benchmarks: capture + verify Llama-3.1 8B and 405B at TP=8; writes RESULTS.md."""
from __future__ import annotations

import platform
import resource
import time
from pathlib import Path

import scalify

RESULTS = Path(__file__).with_name("RESULTS.md")
CASES = [
    ("Llama-3.1-8B, 32 layers, TP=8", "configs/experiments/llama-3.1-8b-tp8.yaml"),
    ("Llama-3.1-405B, 126 layers, TP=8", "configs/experiments/llama-3.1-405b-tp8.yaml"),
]


def main() -> None:
    rows = []
    for title, config in CASES:
        start = time.perf_counter()
        report = scalify.verify(config)
        wall = time.perf_counter() - start
        t = report.timings
        rows.append(f"| {title} | {report.verdict} | {t['capture_s']:.1f} | {t['verify_s']:.1f} | "
                    f"{wall:.1f} | {report.stats['windows']} | {report.stats['memo_hits']} | "
                    f"{report.stats['layer_memo_hits']} |")
        print(rows[-1], flush=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    RESULTS.write_text("\n".join([
        "# Benchmark results", "",
        f"Machine: {platform.machine()}, {platform.python_version()}, 2 cores; "
        f"peak RSS {peak_gb:.2f} GB. Command: `make bench`.", "",
        "| case | verdict | capture s | verify s | end-to-end s | egglog windows | window memo hits "
        "| layers reused |",
        "|---|---|---|---|---|---|---|---|", *rows, ""]))


if __name__ == "__main__":
    main()
