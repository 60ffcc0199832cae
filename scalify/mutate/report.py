"""A campaign's results: the per-operator table, the survivors, and the JSON record."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .campaign import Campaign, Judgement
from .operators import OPERATORS

COLUMNS = ("operator", "mutants", "number-changing", "caught", "survivors", "equivalent",
           "false alarms")


def _counts(judgements: list[Judgement]) -> list[int]:
    changing = [j for j in judgements if j.numbers_change]
    return [len(judgements), len(changing), sum(j.caught for j in judgements),
            sum(j.survivor for j in judgements), len(judgements) - len(changing),
            sum(j.false_alarm for j in judgements)]


def rows(campaign: Campaign) -> list[list[str]]:
    """One row per operator, then the total."""
    table = [[operator, *map(str, _counts([j for j in campaign.judgements
                                          if j.operator == operator]))] for operator in OPERATORS]
    return table + [["total", *map(str, _counts(campaign.judgements))]]


def print_campaign(campaign: Campaign, console: Console) -> None:
    """The table, then every survivor and false alarm with its operator, node and source line
    (and for a false alarm, where the verifier reported it)."""
    table = Table(*COLUMNS, title=f"Mutation campaign: {campaign.name}")
    for row in rows(campaign):
        table.add_row(*row)
    console.print(table)
    for j in campaign.survivors():
        console.print(f"[bold red]survivor[/] {j.operator} at {j.node} ({j.what}), {j.source}")
    for j in campaign.false_alarms():
        console.print(f"[yellow]false alarm[/] {j.operator} at {j.node} ({j.what}), {j.source}; "
                      f"reported at {j.detail or j.verdict}")


def write_json(campaigns: list[Campaign], path: str | Path) -> None:
    """Every judgement of every campaign, by campaign name."""
    record = {c.name: [asdict(j) for j in c.judgements] for c in campaigns}
    Path(path).write_text(json.dumps(record, indent=2))
