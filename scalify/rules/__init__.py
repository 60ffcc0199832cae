"""Rewrite rules, generated from op traits and grouped by theory, and the egglog program they make."""
from __future__ import annotations

from dataclasses import replace

from . import context, elementwise, embedding, matmul, movement, ranks, reduction, rows
from .base import Rule
from .families import FACTS
from .terms import DECLARATIONS, render

RULESET = "lemmas"
PER_RANK_RULESET = "per_rank"  # run only for programs that are not rank-symmetric
THEORIES = (elementwise, reduction, matmul, movement, embedding, rows)


def all_rules() -> list[Rule]:
    return ([rule for theory in THEORIES for rule in theory.rules()] + movement.per_rank_rules()
            + rank_rules() + context.rules())


def rank_rules() -> list[Rule]:
    """The rank-family theory (its own ruleset, run only for symmetric programs)."""
    return [replace(rule, world=ranks.WORLD) for rule in ranks.rules()]


def prelude() -> str:
    """Declarations, trait facts and every rule, as one egglog program."""
    relations = "\n".join(f"(relation {name} (String))" for name in sorted(FACTS))
    facts = "\n".join(f"({name} {render(member)})" for name, members in sorted(FACTS.items())
                      for member in sorted(members))
    rules = "\n".join(rule.egglog(RULESET) for theory in THEORIES for rule in theory.rules())
    per_rank = "\n".join(rule.egglog(PER_RANK_RULESET) for rule in movement.per_rank_rules())
    family_rules = "\n".join(rule.egglog(ranks.RULESET) for rule in rank_rules())
    block_rules = "\n".join(rule.egglog(context.RULESET) for rule in context.rules())
    probe = "(rule ((target t k) (= t (dist n))) ((same k n)) :ruleset probe)"
    rulesets = [f"(ruleset {name})" for name in
                (RULESET, "probe", "window", ranks.RULESET, PER_RANK_RULESET, context.RULESET)]
    return "\n".join([DECLARATIONS, relations, *rulesets, facts, rules, per_rank, family_rules,
                      block_rules, *ranks.fact_rules(), *movement.FACT_RULES, probe])
