"""Rules as data: a rewrite with side conditions, its egglog text, and a numeric example generator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .terms import App, At, Family, Term, evaluate, parse, uniform_literal

Example = Callable[[torch.Generator, dict[str, str]], dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    """`lhs` rewrites to `rhs` where every `when` condition holds.

    `families` maps a variable to the op keys it ranges over (a template covers the whole
    trait group); `example(gen, choice)` returns variable bindings that satisfy the conditions,
    so a test can check both sides numerically for every instance. A rule whose `lhs` is a
    bare variable needs a `trigger`: a term whose presence in the e-graph fires it.
    """

    name: str
    lhs: str
    rhs: str
    example: Example
    when: tuple[str, ...] = ()
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)
    world: int = 1  # ranks a test evaluates both sides on (rank-family rules use several)
    trigger: str | None = None

    def egglog(self, ruleset: str) -> str:
        if self.trigger is not None:
            query = " ".join([f"(= fired {self.trigger})", *self.when])
            return f"(rule ({query}) ((union {self.lhs} {self.rhs})) :ruleset {ruleset})"
        conditions = f" :when ({' '.join(self.when)})" if self.when else ""
        return f"(rewrite {self.lhs} {self.rhs}{conditions} :ruleset {ruleset})"

    def instances(self) -> list[dict[str, str]]:
        """Every choice of family members (one empty choice when the rule has no families)."""
        choices: list[dict[str, str]] = [{}]
        for name, members in self.families.items():
            choices = [{**c, name: m} for c in choices for m in members]
        return choices


def check_conditions(rule: Rule, env: dict[str, Any], facts: dict[str, set[str]],
                     at: At = At()) -> bool:
    """Evaluate the rule's side conditions on concrete bindings, on rank `at`."""
    return all(_condition(parse(text), env, facts, at) for text in rule.when)


def _condition(term: Term, env: dict[str, Any], facts: dict[str, set[str]], at: At) -> bool:
    assert isinstance(term, App)
    if term.head == "inv":  # the same value on every rank
        return not isinstance(env[str(term.args[0]).lstrip("?")], Family)
    if term.head == "ones":  # every element 1
        value = _value(term.args[0], env, at)
        return isinstance(value, torch.Tensor) and bool((value == 1).all())
    if term.head == "uniform":  # every element the literal
        value = _value(term.args[0], env, at)
        return isinstance(value, torch.Tensor) and uniform_literal(value) == term.args[1]
    if term.head in facts:
        return _value(term.args[0], env, at) in facts[term.head]
    left, right = (_value(a, env, at) for a in term.args)
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return torch.equal(left, right) == (term.head == "=")
    return {"=": left == right, "!=": left != right, "<": left < right, "<=": left <= right,
            ">": left > right, ">=": left >= right}[term.head]


def _value(term: Term, env: dict[str, Any], at: At) -> Any:
    return evaluate(term, env, at)


def evaluate_sides(rule: Rule, env: dict[str, Any], at: At = At()) -> tuple[Any, Any]:
    """Both sides of the rule on concrete bindings, on rank `at`."""
    return evaluate(parse(rule.lhs), env, at), evaluate(parse(rule.rhs), env, at)
