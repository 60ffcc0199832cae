"""Rewrite rules, generated from op traits and grouped by theory, and the egglog program they make."""
from __future__ import annotations

from . import elementwise, embedding, matmul, movement, reduction
from .base import Rule
from .families import FACTS
from .terms import DECLARATIONS, render

RULESET = "lemmas"
THEORIES = (elementwise, reduction, matmul, movement, embedding)


def all_rules() -> list[Rule]:
    return [rule for theory in THEORIES for rule in theory.rules()]


def prelude() -> str:
    """Declarations, trait facts and every rule, as one egglog program."""
    relations = "\n".join(f"(relation {name} (String))" for name in sorted(FACTS))
    facts = "\n".join(f"({name} {render(member)})" for name, members in sorted(FACTS.items())
                      for member in sorted(members))
    rules = "\n".join(rule.egglog(RULESET) for rule in all_rules())
    probe = "(rule ((target t k) (= t (dist n))) ((same k n)) :ruleset probe)"
    return "\n".join([DECLARATIONS, relations, f"(ruleset {RULESET})", "(ruleset probe)", "(ruleset window)", facts,
                      rules, *movement.FACT_RULES, probe])
