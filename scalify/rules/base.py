"""Rules as data: a rewrite with side conditions, its egglog text, and a numeric example generator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .terms import App, Term, evaluate, parse

Example = Callable[[torch.Generator, dict[str, str]], dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    """`lhs` rewrites to `rhs` where every `when` condition holds.

    `families` maps a variable to the op keys it ranges over (a template covers the whole
    trait group); `example(gen, choice)` returns variable bindings that satisfy the conditions,
    so a test can check both sides numerically for every instance.
    """

    name: str
    lhs: str
    rhs: str
    example: Example
    when: tuple[str, ...] = ()
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def egglog(self, ruleset: str) -> str:
        conditions = f" :when ({' '.join(self.when)})" if self.when else ""
        return f"(rewrite {self.lhs} {self.rhs}{conditions} :ruleset {ruleset})"

    def instances(self) -> list[dict[str, str]]:
        """Every choice of family members (one empty choice when the rule has no families)."""
        choices: list[dict[str, str]] = [{}]
        for name, members in self.families.items():
            choices = [{**c, name: m} for c in choices for m in members]
        return choices


def check_conditions(rule: Rule, env: dict[str, Any], facts: dict[str, set[str]]) -> bool:
    """Evaluate the rule's side conditions on concrete bindings."""
    return all(_condition(parse(text), env, facts) for text in rule.when)


def _condition(term: Term, env: dict[str, Any], facts: dict[str, set[str]]) -> bool:
    assert isinstance(term, App)
    if term.head in facts:
        return _value(term.args[0], env) in facts[term.head]
    left, right = (_value(a, env) for a in term.args)
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.equal(left, right) == (term.head == "=")
    return {"=": left == right, "!=": left != right, "<": left < right, "<=": left <= right,
            ">": left > right, ">=": left >= right}[term.head]


def _value(term: Term, env: dict[str, Any]) -> Any:
    return evaluate(term, env)


def evaluate_sides(rule: Rule, env: dict[str, Any]) -> tuple[Any, Any]:
    """Both sides of the rule on concrete bindings."""
    return evaluate(parse(rule.lhs), env), evaluate(parse(rule.rhs), env)
