"""CI's reduced mutation campaign: every number-changing mutant of tiny Llama TP2 is caught, and
every equivalent one (a number-preserving rewrite) verified."""
from __future__ import annotations

from scalify.matrix import Cell
from scalify.mutate.campaign import run_campaign
from scalify.mutate.operators import NUMBER_PRESERVING
from scalify.mutate.report import rows
from scalify.mutate.subject import capture_subject


def test_reduced_campaign_has_no_survivors() -> None:
    subject = capture_subject(Cell("llama", "TP2", False, (("tensor_parallel", 2),)).experiment())
    campaign = run_campaign(subject, budget=1, seed=0)
    assert {j.operator for j in campaign.judgements} >= {"drop collective", "swap reduce op"}
    assert any(j.caught for j in campaign.judgements)
    assert not campaign.survivors(), [(j.operator, j.node, j.what, j.source)
                                      for j in campaign.survivors()]
    equivalent = [j for j in campaign.judgements if not j.numbers_change]
    assert {j.operator for j in equivalent} >= set(NUMBER_PRESERVING) - {"negated add"}
    assert not campaign.false_alarms(), [(j.operator, j.node, j.what, j.detail)
                                         for j in campaign.false_alarms()]
    assert rows(campaign)[-1][0] == "total"
