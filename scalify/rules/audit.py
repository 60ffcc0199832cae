"""Rule audit: each rule instance checked on variants of its example, numerically and in egglog.

Variants re-draw the example's tensors with other seeds, move its integers (dims, sizes,
offsets) by one or two, singly and in pairs, change one axis of every tensor or one size
wherever it occurs (random shapes), and swap the values its side conditions test (trait keys;
invariant tensors made rank-varying; ones made other values).
A variant whose lhs does not evaluate (the typed evaluator of terms.py refuses it) is not a
term and is not checked numerically. egglog runs the example and every variant that changes a
value the conditions read: the rule alone in a fresh e-graph with the variants' concrete terms
and the facts a window would state (every leaf's dim sizes, invariance of the rank-invariant
leaves, which leaves are ones, the trait facts, and the tensor equalities the conditions test where they hold), run
once. Sound means: where the Python conditions hold, both sides agree on every rank; egglog
unifies the sides exactly where the Python conditions hold.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from egglog import bindings

from . import trait_facts
from .base import Rule, check_conditions
from .examples import tensor
from .families import BINARY_KEYS, KINDS, UNARY_KEYS, example_traits, share_facts
from .terms import (DECLARATIONS, App, At, Family, IndexOutOfRange, Term, evaluate, render,
                    shape_facts, uniform_literal)
from .terms import parse as parse_term

RULESET = "audit"
SEEDS = (1, 2)  # re-draws of the example's tensors
STEPS = (-2, -1, 1, 2)  # moves of one integer
PAIR_STEPS = (-1, 1)  # moves of two integers the conditions read, together
AXIS_STEPS = (-1, 1, 2)  # changes to one axis of every tensor
SIZE_STEPS = (-1, 1)  # changes to one size wherever it occurs
ARITHMETIC = frozenset("+-*/%")
TRAIT_KEYS = UNARY_KEYS + BINARY_KEYS  # op keys tried in place of a trait-tested one


@dataclass(frozen=True)
class Variant:
    """Bindings derived from a rule's example; `label` says how."""

    label: str
    env: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """One variant: do the conditions hold (on every rank), do both sides agree (None where the
    lhs is ill-typed or indexes outside its range: not a term), did egglog unify them (None
    where they are one term, or not run: egglog runs the example and the variants that change
    a value the conditions read)."""

    label: str
    holds: bool
    agree: bool | None
    fired: bool | None

    @property
    def unsound(self) -> bool:
        """The rule (as Python or egglog reads its conditions) equates two sides that differ."""
        return self.agree is False and (self.holds or self.fired is True)

    @property
    def mismatch(self) -> bool:
        """egglog's encoding of the conditions disagrees with their Python meaning."""
        return self.fired is not None and self.fired != self.holds


@dataclass(frozen=True)
class Audit:
    """The audit of one rule instance."""

    rule: Rule
    choice: dict[str, str]
    outcomes: list[Outcome]

    @property
    def typed(self) -> list[Outcome]:
        """The variants that are terms (checked numerically)."""
        return [o for o in self.outcomes if o.agree is not None]

    @property
    def satisfying(self) -> int:
        return sum(o.holds for o in self.typed)

    @property
    def violating(self) -> int:
        """Variants that violate the conditions (egglog runs them all: they change a value the
        conditions read)."""
        return sum(not o.holds for o in self.outcomes)

    @property
    def boundary(self) -> int:
        """Terms that violate the conditions and whose sides differ: firing would be unsound."""
        return sum(not o.holds and o.agree is False for o in self.outcomes)

    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.unsound or o.mismatch]


def audit(rule: Rule, choice: dict[str, str]) -> Audit:
    """Check one instance of `rule` on every variant of its example."""
    found = variants(rule, choice)
    read = _condition_vars(rule)
    checked = [i for i, variant in enumerate(found)
               if i == 0 or any(variant.env[name] is not found[0].env[name] for name in read)]
    fired = dict(zip(checked, _fired(rule, [found[i].env for i in checked])))
    return Audit(rule, choice, [Outcome(variant.label, *_judge(rule, variant.env), fired.get(i))
                                for i, variant in enumerate(found)])


# Variants.

def variants(rule: Rule, choice: dict[str, str]) -> list[Variant]:
    """The example itself first, then its re-draws, moves and swaps (deterministic)."""
    env = rule.example(torch.Generator().manual_seed(0), choice)
    found = [Variant("example", env)]
    found += [Variant(f"seed {seed}", rule.example(torch.Generator().manual_seed(seed), choice))
              for seed in SEEDS]
    found += (_integer_moves(rule, env) + _axis_changes(env) + _lone_axis_changes(env)
              + _size_changes(env))
    return found + _swaps(rule, env)


def _integer_moves(rule: Rule, env: dict[str, Any]) -> list[Variant]:
    """Each integer moved by STEPS, and pairs of integers the conditions read moved together.
    A move keeps the sign: dims and sizes are non-negative in terms, offsets negative."""
    ints = [name for name, value in env.items() if type(value) is int]
    read = sorted(set(ints) & _condition_vars(rule))
    moves = [((name, step),) for name in ints for step in STEPS]
    moves += [((a, s), (b, t)) for a, b in itertools.combinations(read, 2)
              for s in PAIR_STEPS for t in PAIR_STEPS]
    found = []
    for move in moves:
        moved = {name: env[name] + step for name, step in move}
        if all((value < 0) == (env[name] < 0) for name, value in moved.items()):
            label = " ".join(f"{name}{step:+d}" for name, step in move)
            found.append(Variant(label, {**env, **moved}))
    return found


def _axis_changes(env: dict[str, Any]) -> list[Variant]:
    """Axis `a` (counted from the front, or from the back) of every tensor that has it
    changed by AXIS_STEPS, with fresh values; once alone and once with the integers that named
    its old size following it."""
    gen = torch.Generator().manual_seed(3)
    ndim = max((t.dim() for t in _tensors(env)), default=0)
    found = []
    for axis in [*range(ndim), *range(-ndim, 0)]:
        for step in AXIS_STEPS:
            resized = {name: _resize(value, axis, step, gen) for name, value in env.items()
                       if isinstance(value, (torch.Tensor, Family))}
            old = {s for t in _tensors(env) if -t.dim() <= axis < t.dim() for s in [t.shape[axis]]}
            if any(v is None for v in resized.values()) or not old:
                continue
            found.append(Variant(f"axis {axis}{step:+d}", {**env, **resized}))
            sizes = {name: value + step for name, value in env.items()
                     if type(value) is int and value in old and value > 1}
            if sizes:
                found.append(Variant(f"axis {axis}{step:+d} with sizes",
                                     {**env, **resized, **sizes}))
    return found


def _lone_axis_changes(env: dict[str, Any]) -> list[Variant]:
    """One axis of one tensor changed by one (fresh values), every other binding kept: two
    operands that stop agreeing in size (a rule may only hold where they agree)."""
    gen = torch.Generator().manual_seed(4)
    found = []
    for name, value in env.items():
        if not isinstance(value, (torch.Tensor, Family)):
            continue
        for axis in range(max(t.dim() for t in _tensors({name: value}))):
            resized = _resize(value, axis, 1, gen)
            if resized is not None:
                found.append(Variant(f"{name} axis {axis}+1", {**env, name: resized}))
    return found


def _size_changes(env: dict[str, Any]) -> list[Variant]:
    """Each size above 1 changed by SIZE_STEPS wherever it occurs: on every tensor axis of
    that size (fresh values) and in every integer equal to it."""
    gen = torch.Generator().manual_seed(5)
    sizes = sorted({size for t in _tensors(env) for size in t.shape if size > 1})
    found = []
    for size, step in itertools.product(sizes, SIZE_STEPS):
        changed = {name: _reshape(value, size, size + step, gen) for name, value in env.items()
                   if isinstance(value, (torch.Tensor, Family))}
        changed |= {name: size + step for name, value in env.items()
                    if type(value) is int and value == size}
        found.append(Variant(f"size {size}{step:+d}", {**env, **changed}))
    return found


def _reshape(value: Any, old: int, new: int, gen: torch.Generator) -> Any:
    if isinstance(value, Family):
        return Family(_reshape(part, old, new, gen) for part in value)
    if old not in value.shape:
        return value
    return _redraw(value, [new if size == old else size for size in value.shape], gen)


def _resize(value: Any, axis: int, step: int, gen: torch.Generator) -> Any:
    if isinstance(value, Family):
        parts = [_resize(part, axis, step, gen) for part in value]
        return None if any(p is None for p in parts) else Family(parts)
    if not -value.dim() <= axis < value.dim():
        return value
    shape = list(value.shape)
    shape[axis] += step
    if shape[axis] < 1:
        return None
    return _redraw(value, shape, gen)


def _one_changed(value: torch.Tensor) -> torch.Tensor:
    """`value` with its first element changed (flipped, or moved off its value)."""
    changed = value.clone().reshape(-1)
    changed[0] = ~changed[0] if value.dtype == torch.bool else (
        1.5 if not torch.isfinite(changed[0]) else changed[0] + 1)
    return changed.reshape(value.shape)


def _redraw(value: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """Fresh values like `value`'s (same dtype and range) in `shape`."""
    if value.dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not value.is_floating_point():
        low, high = (int(value.min()), int(value.max())) if value.numel() else (0, 1)
        return torch.randint(low, high + 1, shape, generator=gen, dtype=value.dtype)
    return tensor(gen, *shape).to(value.dtype)


def _swaps(rule: Rule, env: dict[str, Any]) -> list[Variant]:
    """Values the conditions test by kind, swapped: another op key for a trait-tested one, and
    rank-varying values for an invariant tensor."""
    gen = torch.Generator().manual_seed(4)
    found = []
    for head, name in _tested(rule):
        if head in example_traits(rule.world):
            found += [Variant(f"{name}={key}", {**env, name: key}) for key in TRAIT_KEYS
                      if key != env[name]]
        elif head == "inv" and isinstance(env[name], torch.Tensor):
            value = env[name]
            ranks = Family(_redraw(value, list(value.shape), gen) for _ in range(rule.world))
            found.append(Variant(f"{name} rank-varying", {**env, name: ranks}))
        elif head == "ones" and isinstance(env[name], torch.Tensor):
            found.append(Variant(f"{name} not ones", {**env, name: env[name] + 1}))
    for text in rule.when:  # a uniform tensor with one element changed
        term = parse(text)
        if isinstance(term, App) and term.head == "uniform":
            name = str(term.args[0]).lstrip("?")
            found.append(Variant(f"{name} not uniform", {**env, name: _one_changed(env[name])}))
    return found


def partial_families(rule: Rule) -> list[str]:
    """Family variables that no condition tests yet range over part of their kind: the egglog
    rule would fire for keys its family leaves out (and its numeric checks never try)."""
    tested = _condition_vars(rule)
    return [name for name, members in rule.families.items()
            if name not in tested and set(members) not in [set(kind) for kind in KINDS]]


def _tested(rule: Rule) -> list[tuple[str, str]]:
    """(fact, variable) for each one-variable fact the conditions test."""
    tested = []
    for text in rule.when:
        term = parse(text)
        if isinstance(term, App) and len(term.args) == 1 and isinstance(term.args[0], str):
            tested.append((term.head, term.args[0].lstrip("?")))
    return tested


def _condition_vars(rule: Rule) -> set[str]:
    return {name for text in rule.when for name in _variables(parse(text))}


def _variables(term: Term) -> list[str]:
    if isinstance(term, App):
        return [name for arg in term.args for name in _variables(arg)]
    return [term[1:]] if isinstance(term, str) and term.startswith("?") else []


def _tensors(env: dict[str, Any]) -> list[torch.Tensor]:
    return [t for value in env.values() if isinstance(value, (torch.Tensor, Family))
            for t in (value if isinstance(value, Family) else [value])]


# Numeric judgement.

def _judge(rule: Rule, env: dict[str, Any]) -> tuple[bool, bool | None]:
    """(the conditions hold on every rank, both sides agree on every rank). An ill-typed rhs
    of a well-typed lhs disagrees with it; agreement is None where the lhs or the trigger is
    ill-typed or a side indexes outside its range (ids lie in [0, vocab))."""
    ranks = At(0, rule.world).each()
    holds = all(_holds(rule, env, at) for at in ranks)
    try:
        left = [evaluate(parse(rule.lhs), env, at) for at in ranks]
        if rule.trigger is not None:  # a trigger that is not a term is in no e-graph
            for at in ranks:
                evaluate(parse(rule.trigger), env, at)
        right = [_evaluate_rhs(rule, env, at) for at in ranks]
    except Exception:  # noqa: BLE001 - any failure to evaluate means the term is ill-typed
        return holds, None
    return holds, all(r is not None and l.shape == r.shape and torch.allclose(
        l.double(), r.double(), rtol=1e-9, atol=1e-9, equal_nan=True) for l, r in zip(left, right))


def _evaluate_rhs(rule: Rule, env: dict[str, Any], at: At) -> torch.Tensor | None:
    """The rhs, or None where it is ill-typed (IndexOutOfRange propagates)."""
    try:
        return evaluate(parse(rule.rhs), env, at)
    except IndexOutOfRange:
        raise
    except Exception:  # noqa: BLE001
        return None


def _holds(rule: Rule, env: dict[str, Any], at: At) -> bool:
    try:
        return check_conditions(rule, env, example_traits(rule.world), at)
    except Exception:  # noqa: BLE001 - a condition that cannot be evaluated does not hold
        return False


# egglog judgement.

def _fired(rule: Rule, envs: list[dict[str, Any]]) -> list[bool | None]:
    """For each env: does one run of the rule, alone in an e-graph holding every env's terms
    and facts, unify its lhs with its rhs (None where they are one term)."""
    texts = [_texts(rule, env, i) for i, env in enumerate(envs)]
    terms = [_loader("terms", [*_facts(rule, env, i), f"(let seed{i} {text[0]})"])
             for i, (env, text) in enumerate(zip(envs, texts)) if text is not None]
    sides = [_loader("sides", [f"(union (side {i} {j}) {side})" for j, side in enumerate(text[1:])])
             for i, text in enumerate(texts) if text is not None]
    program = [DECLARATIONS, trait_facts(), "(constructor side (i64 i64) T)",
               "(relation fired_at (i64))", f"(set (world) {rule.world})",
               *(f"({trait} {render(key)})" for trait, keys in share_facts(rule.world).items()
                 for key in sorted(keys)),
               *(f"(ruleset {name})" for name in (RULESET, "terms", "sides", "probe")),
               rule.egglog(RULESET), *terms, *sides,
               "(rule ((= x (side i 0)) (= x (side i 1))) ((fired_at i)) :ruleset probe)",
               *(f"(run {name} 1)" for name in ("terms", RULESET, "sides", "probe")),
               f"(print-function fired_at {len(envs) + 1})"]
    egraph = bindings.EGraph()
    printed = str(egraph.run_program(*egraph.parse_program("\n".join(program)))[-1])
    unified = {int(i) for i in re.findall(r"\(fired_at (\d+)\)", printed)}
    return [None if text is not None and text[1] == text[2] else i in unified
            for i, text in enumerate(texts)]


def _loader(ruleset: str, actions: list[str]) -> str:
    """A query-less rule doing `actions` (fewer commands than one each: each costs time)."""
    return f"(rule () ({' '.join(actions)}) :ruleset {ruleset})"


def _texts(rule: Rule, env: dict[str, Any], i: int) -> tuple[str, str, str] | None:
    """The concrete seed (trigger or lhs), lhs and rhs; None where their integer arithmetic
    fails (a division by zero: egglog could not build them either)."""
    try:
        seed, lhs, rhs = (_concrete(text, env, i)
                          for text in (rule.trigger or rule.lhs, rule.lhs, rule.rhs))
        return seed, lhs, rhs
    except ZeroDivisionError:
        return None


def _facts(rule: Rule, env: dict[str, Any], i: int) -> list[str]:
    """What a window states about env's leaves, and the tensor equalities the conditions test
    that hold on every rank."""
    facts = []
    for name, value in env.items():
        if isinstance(value, (torch.Tensor, Family)):
            leaf = _leaf(name, i)
            shape = (value[0] if isinstance(value, Family) else value).shape
            facts += shape_facts(leaf, shape)
            if isinstance(value, torch.Tensor):
                facts.append(f"(inv {leaf})")
                if value.is_floating_point() and bool((value == 1).all()):
                    facts.append(f"(ones {leaf})")
                literal = uniform_literal(value)
                if literal is not None:
                    facts.append(f'(uniform {leaf} "{literal}")')
    for text in rule.when:
        term = parse(text)
        if term.head == "=" and _equal_tensors(term, env, rule.world):
            left, right = (render(_substitute(a, env, i)) for a in term.args)
            facts.append(f"(union {left} {right})")
    return facts


def _equal_tensors(term: App, env: dict[str, Any], world: int) -> bool:
    try:
        values = [[evaluate(a, env, at) for a in term.args] for at in At(0, world).each()]
    except Exception:  # noqa: BLE001 - not evaluable: no fact
        return False
    return all(isinstance(l, torch.Tensor) and isinstance(r, torch.Tensor) and torch.equal(l, r)
               for l, r in values)


def _concrete(text: str, env: dict[str, Any], i: int) -> str:
    return render(_substitute(parse(text), env, i))


def _substitute(term: Term, env: dict[str, Any], i: int) -> Term:
    """The pattern with env's values: integers and strings as literals, tensors as leaves,
    integer arithmetic folded as the numeric check computes it."""
    if isinstance(term, App):
        applied = App(term.head, tuple(_substitute(a, env, i) for a in term.args))
        return evaluate(applied, {}) if term.head in ARITHMETIC else applied
    if not (isinstance(term, str) and term.startswith("?")):
        return term
    name = term[1:]
    value = env[name]
    return parse(_leaf(name, i)) if isinstance(value, (torch.Tensor, Family)) else value


def _leaf(name: str, i: int) -> str:
    return f'(dist "{i}/{name}")'


@cache
def parse(text: str) -> Term:
    """Rule texts parsed once (a term is immutable)."""
    return parse_term(text)
