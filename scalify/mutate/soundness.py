"""`make soundness`: the mutation campaign over tiny Llama and GPT-2 at TP 2/4/8 (one layer,
forward). Exits non-zero when a number-changing mutant verifies, or when false alarms reach 5%
of a configuration's equivalent mutants."""
from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ..matrix import Cell
from .campaign import Campaign, run_campaign
from .report import print_campaign, write_json
from .subject import capture_subject

CELLS = [Cell(family, f"TP{tp}", False, (("tensor_parallel", tp),))
         for family in ("llama", "gpt2") for tp in (2, 4, 8)]


FALSE_ALARM_TARGET = 0.05  # of equivalent mutants


def false_alarm_rate(campaign: Campaign) -> float:
    """False alarms as a share of the equivalent mutants (0 when there are none)."""
    equivalent = [j for j in campaign.judgements if not j.numbers_change]
    return sum(j.false_alarm for j in equivalent) / len(equivalent) if equivalent else 0.0


def _summary(campaign: Campaign) -> str:
    changing = [j for j in campaign.judgements if j.numbers_change]
    equivalent = len(campaign.judgements) - len(changing)
    alarms = sum(j.false_alarm for j in campaign.judgements)
    caught = sum(j.caught for j in changing)
    return (f"{campaign.name}: caught {caught}/{len(changing)} number-changing mutants; "
            f"false alarms {alarms}/{equivalent} equivalent mutants "
            f"({false_alarm_rate(campaign):.0%}, target under {FALSE_ALARM_TARGET:.0%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8, help="mutants per operator (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every judged mutant here")
    args = parser.parse_args(argv)
    console = Console(width=120)  # the whole table, also when piped
    campaigns = []
    for cell in CELLS:
        campaign = run_campaign(capture_subject(cell.experiment()), args.budget, args.seed)
        print_campaign(campaign, console)
        campaigns.append(campaign)
    for campaign in campaigns:
        console.print(_summary(campaign))
    if args.json:
        write_json(campaigns, args.json)
    missed = any(c.survivors() or false_alarm_rate(c) >= FALSE_ALARM_TARGET for c in campaigns)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
