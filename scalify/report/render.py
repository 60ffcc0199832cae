"""Renders a report: rich terminal summary, JSON, and a self-contained HTML page."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..ir.graph import SourceLoc
from .model import Discrepancy, Report


def to_json(report: Report, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report.to_dict(), indent=2, default=str))


_COLOURS = {"verified": ("green", "#1a7f37"), "unknown": ("yellow", "#9a6700")}


def print_summary(report: Report, console: Console) -> None:
    colour = _COLOURS.get(report.verdict, ("red", ""))[0]
    console.print(f"[bold {colour}]{report.verdict.upper()}[/] {report.name}")
    table = Table(show_header=True, header_style="bold")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    for stage, seconds in report.timings.items():
        table.add_row(stage.removesuffix("_s"), f"{seconds:.2f}")
    console.print(table)
    console.print(", ".join(f"{k}: {v}" for k, v in report.stats.items()))
    if report.numeric is not None:
        console.print(_numeric_summary(report.numeric))
    for reason in report.unknown:
        console.print(f"\n[bold yellow]unknown[/]: {reason}")
    for number, d in enumerate(report.discrepancies, 1):
        console.print(f"\n[bold red]discrepancy {number}[/]: reference {d.ref_op} in {d.module or 'top'}")
        console.print(f"  reference: {d.ref_source}  {d.ref_source.code}")
        console.print(f"  distributed: [bold]{d.dist_source}[/]  {d.dist_source.code}")
        if d.dist_source.callers:
            console.print(f"    called from {', '.join(d.dist_source.callers)}")
        if d.dist_source.scaled_at:
            console.print(f"    also scaled at {', '.join(d.dist_source.scaled_at)}")
        if d.dist_source.passed_at:
            console.print(f"    passed on at {', '.join(d.dist_source.passed_at)}")
        if d.dist_source.values_from:
            console.print(f"    values it reads set at {', '.join(d.dist_source.values_from)}")
        console.print(f"  found: {d.found[:300]}")
        console.print(f"  expected: {d.expected}")
        console.print(f"  hint: {d.hint}")
        for loc in d.path:
            console.print(f"  rank op it depends on: {loc}  {loc.code}")
            if loc.passed_at:
                console.print(f"    passed on at {', '.join(loc.passed_at)}")
            if loc.values_from:
                console.print(f"    values it reads set at {', '.join(loc.values_from)}")
        for placement in d.placements:
            console.print(f"  placement: {placement}")


def _numeric_summary(numeric: dict) -> str:
    if numeric["agrees"] is None:
        return f"numeric cross-check: {numeric['skipped']}"
    agrees = "agrees" if numeric["agrees"] else "DIFFERS"
    return f"numeric cross-check: max relative error {numeric['max_relative_error']:.3g} ({agrees})"


def to_html(report: Report, path: str | Path) -> None:
    """One page, no external assets: verdict, timings, statistics, then each discrepancy."""
    timings = {stage.removesuffix("_s"): f"{seconds:.2f}" for stage, seconds in report.timings.items()}
    numeric = ("" if report.numeric is None
               else f"<p class='numeric'>{escape(_numeric_summary(report.numeric))}</p>")
    sections = "".join(f"<section class='unknown'><h3>Unknown</h3><p>{escape(reason)}</p></section>"
                       for reason in report.unknown)
    sections += "".join(_discrepancy_html(number, d)
                        for number, d in enumerate(report.discrepancies, 1))
    colour = _COLOURS.get(report.verdict, ("", "#cf222e"))[1]
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>Scalify: {escape(report.name)} ({escape(report.verdict)})</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
pre{{background:#f6f8fa;padding:.4em;margin:.2em 0}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}.module,.callers{{color:#57606a}}
.source{{margin:.6em 0}}.verdict{{color:{colour}}}</style></head><body>
<h1>Scalify report: {escape(report.name)}</h1><h2 class="verdict" id="verdict">{escape(report.verdict)}</h2>
<h3>Timings (s)</h3>{_table(timings, "timings")}
<h3>Statistics</h3>{_table({k: str(v) for k, v in report.stats.items()}, "stats")}{numeric}
{sections}</body></html>"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(page)


def _discrepancy_html(number: int, d: Discrepancy) -> str:
    """The reference op, the distributed line blamed, found vs expected, and the rank nodes nearby."""
    relation = _table({"Found": d.found, "Expected": d.expected}, "relation")
    nearby = "".join(_source_html(loc, "nearby") for loc in d.nearby)
    nearby_html = f"<h4>Rank nodes nearby</h4>{nearby}" if nearby else ""
    path = "".join(_source_html(loc, "path") for loc in d.path)
    path_html = (f"<h4>Rank ops it depends on, back to values proven equal</h4>{path}"
                 if path else "")
    return (f"<section class='discrepancy'><h3>Discrepancy {number}: reference "
            f"<code>{escape(d.ref_op)}</code> ({escape(d.ref_node)}) in "
            f"<code>{escape(d.module or 'top')}</code></h3>"
            f"<h4>Reference op</h4>{_source_html(d.ref_source, 'reference')}"
            f"<h4>Distributed source</h4>{_source_html(d.dist_source, 'distributed')}"
            f"{relation}<p class='hint'><b>Hint</b>: {escape(d.hint)}</p>"
            f"{_list_html('Inputs', d.inputs)}"
            f"{path_html}{_list_html('Sharded parameters feeding this op', d.placements)}"
            f"{nearby_html}</section>")


def _source_html(loc: SourceLoc, role: str) -> str:
    """`file:line`, module path, the code on that line and the user frames that called it."""
    callers = (f"<div class='callers'>called from {escape(', '.join(loc.callers))}</div>"
               if loc.callers else "") + (
        f"<div class='callers'>also scaled at {escape(', '.join(loc.scaled_at))}</div>"
        if loc.scaled_at else "") + (
        f"<div class='callers'>passed on at {escape(', '.join(loc.passed_at))}</div>"
        if loc.passed_at else "") + (
        f"<div class='callers'>values it reads set at {escape(', '.join(loc.values_from))}</div>"
        if loc.values_from else "")
    return (f"<div class='source {role}'><code class='location'>{escape(str(loc))}</code> "
            f"<span class='module'>{escape(loc.module)}</span>"
            f"<pre class='code'>{escape(loc.code)}</pre>{callers}</div>")


def _table(rows: dict[str, str], role: str) -> str:
    cells = "".join(f"<tr><th>{escape(key)}</th><td>{escape(value)}</td></tr>"
                    for key, value in rows.items())
    return f"<table class='{role}'>{cells}</table>"


def _list_html(title: str, items: list[str]) -> str:
    if not items:
        return ""
    return f"<p>{title}:</p><ul>{''.join(f'<li>{escape(item)}</li>' for item in items)}</ul>"
