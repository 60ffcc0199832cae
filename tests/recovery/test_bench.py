"""`make bench-scar ARGS=--quick` writes its table into its own section of RESULTS.md."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_bench_writes_only_its_own_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nother figures\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scar.py"), "--quick",
                    "--results", str(results)], check=True, env=env, capture_output=True,
                   timeout=120)
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nother figures\n")
    section = text.split("<!-- scar:start -->")[1].split("<!-- scar:end -->")[0]
    for workload in ("mlr", "mf", "lda"):
        for strategy in ("traditional", "partial", "partial + prioritized"):
            assert f"| {workload} | {strategy} | 4 |" in section
