"""Rewrite rules, generated from op traits and grouped by theory, and the egglog program they make."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from . import context, elementwise, embedding, matmul, movement, ranks, reduction, rows
from .base import Rule
from .families import FACTS, SHARE_TRAITS
from .terms import DECLARATIONS, render

RULESET = "lemmas"
PER_RANK_RULESET = "per_rank"  # run only for programs that are not rank-symmetric
INVERSES_RULESET = "inverses"  # run only for windows that find no relation without it
INWARD_RULESET = "inward"  # likewise, with every iteration after the inverses
SLICE_ORDER_RULESET = "slice_order"  # run only where the context rules are not
THEORIES = (elementwise, reduction, matmul, movement, embedding, rows)


def all_rules() -> list[Rule]:
    return ([rule for theory in THEORIES for rule in theory.rules()] + movement.per_rank_rules()
            + movement.inverse_rules() + movement.inward_rules() + movement.slice_order_rules() + rank_rules()
            + context.rules())


def rank_rules() -> list[Rule]:
    """The rank-family theory (its own ruleset, run only for symmetric programs)."""
    return [replace(rule, world=ranks.WORLD) for rule in ranks.rules()]


OPTIONAL_RULESETS = (PER_RANK_RULESET, ranks.RULESET, context.RULESET, INVERSES_RULESET,
                     INWARD_RULESET, SLICE_ORDER_RULESET)


def trait_facts() -> str:
    """The trait relations (`additive`, ...) and their members, as egglog commands (the share
    traits have their members stated per window)."""
    relations = [f"(relation {name} (String))" for name in sorted([*FACTS, *SHARE_TRAITS])]
    facts = [f"({name} {render(member)})" for name, members in sorted(FACTS.items())
             for member in sorted(members)]
    return "\n".join(relations + facts)


def prelude(rulesets: Collection[str] = OPTIONAL_RULESETS) -> str:
    """Declarations, trait facts and the rules (the lemmas and those of the optional
    `rulesets`: loading a ruleset's rules costs time even where it never runs), as one egglog
    program."""
    rules = [rule.egglog(RULESET) for theory in THEORIES for rule in theory.rules()]
    optional = {PER_RANK_RULESET: [rule.egglog(PER_RANK_RULESET) for rule in movement.per_rank_rules()],
                ranks.RULESET: [rule.egglog(ranks.RULESET) for rule in rank_rules()] + ranks.fact_rules(),
                context.RULESET: [rule.egglog(context.RULESET) for rule in context.rules()]
                + list(context.FACT_RULES),
                INVERSES_RULESET: [rule.egglog(INVERSES_RULESET) for rule in movement.inverse_rules()],
                INWARD_RULESET: [rule.egglog(INWARD_RULESET) for rule in movement.inward_rules()],
                SLICE_ORDER_RULESET: [rule.egglog(SLICE_ORDER_RULESET)
                                      for rule in movement.slice_order_rules()]}
    probe = "(rule ((target t k) (= t (dist n))) ((same k n)) :ruleset probe)"
    declared = [f"(ruleset {name})" for name in (RULESET, "probe", "window", *OPTIONAL_RULESETS)]
    return "\n".join([DECLARATIONS, trait_facts(), *declared, *rules,
                      *(line for name in OPTIONAL_RULESETS if name in rulesets
                        for line in optional[name]),
                      *movement.FACT_RULES, *elementwise.FACT_RULES, probe])
