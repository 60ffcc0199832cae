"""Renders a report: rich terminal summary, JSON, and a self-contained HTML page."""
from __future__ import annotations

import html
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .model import Report


def to_json(report: Report, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report.to_dict(), indent=2, default=str))


def print_summary(report: Report, console: Console) -> None:
    colour = "green" if report.verified else "red"
    console.print(f"[bold {colour}]{report.verdict.upper()}[/] {report.name}")
    table = Table(show_header=True, header_style="bold")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, seconds in report.timings.items():
        table.add_row(stage.removesuffix("_s"), f"{seconds:.2f}")
    console.print(table)
    console.print(", ".join(f"{k}: {v}" for k, v in report.stats.items()))
    if report.numeric is not None:
        agrees = "agrees" if report.numeric["agrees"] else "DIFFERS"
        console.print(f"numeric cross-check: max relative error "
                      f"{report.numeric['max_relative_error']:.3g} ({agrees})")
    for number, d in enumerate(report.discrepancies, 1):
        console.print(f"\n[bold red]discrepancy {number}[/]: reference {d.ref_op} in {d.module or 'top'}")
        console.print(f"  reference: {d.ref_source}  {d.ref_source.code}")
        console.print(f"  distributed: [bold]{d.dist_source}[/]  {d.dist_source.code}")
        if d.dist_source.callers:
            console.print(f"    called from {', '.join(d.dist_source.callers)}")
        console.print(f"  found: {d.found[:300]}")
        console.print(f"  expected: {d.expected}")
        console.print(f"  hint: {d.hint}")
        for placement in d.placements:
            console.print(f"  placement: {placement}")


def to_html(report: Report, path: str | Path) -> None:
    """One page, no external assets."""
    e = html.escape
    rows = "".join(f"<tr><td>{e(k)}</td><td>{v:.2f}</td></tr>" for k, v in report.timings.items())
    stats = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in report.stats.items())
    parts = []
    for number, d in enumerate(report.discrepancies, 1):
        nearby = "".join(f"<li><code>{e(str(loc))}</code> <pre>{e(loc.code)}</pre>"
                         f"called from {e(', '.join(loc.callers))}</li>" for loc in d.nearby)
        inputs = "".join(f"<li>{e(text)}</li>" for text in d.inputs)
        parts.append(
            f"<section class='discrepancy'><h3>Discrepancy {number}: reference <code>{e(d.ref_op)}</code>"
            f" in <code>{e(d.module)}</code></h3>"
            f"<p>Reference: <code>{e(str(d.ref_source))}</code><pre>{e(d.ref_source.code)}</pre></p>"
            f"<p>Distributed: <code class='location'>{e(str(d.dist_source))}</code>"
            f"<pre>{e(d.dist_source.code)}</pre></p>"
            f"<p><b>Found</b>: {e(d.found)}</p><p><b>Expected</b>: {e(d.expected)}</p>"
            f"<p><b>Hint</b>: {e(d.hint)}</p><p>Inputs:</p><ul>{inputs}</ul>"
            f"<p>Sharded parameters feeding this op:</p>"
            f"<ul>{''.join(f'<li>{e(p)}</li>' for p in d.placements)}</ul>"
            f"<p>Distributed lines nearby:</p><ul>{nearby}</ul></section>")
    numeric = ""
    if report.numeric is not None:
        numeric = (f"<p>Numeric cross-check: max relative error "
                   f"{report.numeric['max_relative_error']:.3g}</p>")
    colour = "#1a7f37" if report.verified else "#cf222e"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Scalify: {e(report.name)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}pre{{background:#f6f8fa;padding:.4em}}
table{{border-collapse:collapse}}td{{border:1px solid #ccc;padding:.2em .6em}}
.verdict{{color:{colour}}}</style></head><body>
<h1>Scalify report: {e(report.name)}</h1><h2 class="verdict" id="verdict">{e(report.verdict)}</h2>
<h3>Timings (s)</h3><table>{rows}</table><h3>Statistics</h3><table>{stats}</table>{numeric}
{''.join(parts)}</body></html>"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(page)
