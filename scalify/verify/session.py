"""A warm egglog e-graph holding the rules; runs one window program at a time, memoized by its text."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

from egglog import bindings

from ..rules import INVERSES_RULESET, INWARD_RULESET, SLICE_ORDER_RULESET, context, prelude
from ..rules.terms import SIZE_CONFLICT, is_relational, parse
from .store import MemoStore

_LEAF = re.compile(r'\(dist "([^"]+)"\)')
_SAME = re.compile(r'\(same "([^"]+)" "([^"]+)"\)')
_SLICED = re.compile(r'\(union \(dist "([^"]+)"\) \(slice ')
_PARTIAL_REPLICA = re.compile(r'^\(union .*(\(dist "[^"]+"\)).* \1\)$', re.M)


@dataclass(frozen=True)
class Outcome:
    """What saturation found for `$y`: the cheapest term, the rank tensors equal to it, and for
    each rank tensor in the term the others equal to it (`(name, other)` pairs). When the window
    states a partial replica (a rank tensor equal to itself with a piece from another rank, as
    Custom layouts do), the slices in the window are probed too: they find the replicated pieces."""

    term: str
    same: tuple[str, ...]
    leaf_aliases: tuple[tuple[str, str], ...] = ()


def canonicalize(program: str) -> tuple[str, list[str]]:
    """Rename rank tensors to v0, v1, ... in order of appearance; return the text and the names."""
    names: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        return f'(dist "v{names.setdefault(match.group(1), str(len(names)))}")'

    text = _LEAF.sub(rename, program)
    return text, list(names)


def _restore(text: str, names: list[str]) -> str:
    return _LEAF.sub(lambda m: f'(dist "{names[int(m.group(1)[1:])]}")', text)


def _batched(egraph: bindings.EGraph, program: str, chunk: int = 16) -> list:
    """A window's commands: its first line, then its facts as one query-less rule (one command
    instead of one per fact), parsed a few lines at a time (every parsed expression keeps the
    text it was parsed from, which egglog copies each time it takes the command)."""
    first, *facts = program.split("\n")
    commands = egraph.parse_program(first)
    if not facts:
        return commands
    actions = [command.action for start in range(0, len(facts), chunk)
               for command in egraph.parse_program("\n".join(facts[start:start + chunk]))]
    span = bindings.RustSpan("window", 0, 0)
    load = bindings.RuleCommand(bindings.Rule(span, actions, [], "", "window"))
    return [*commands, load, *egraph.parse_program("(run window 1)")]


def _nodes(outputs: list) -> int:
    """E-nodes at the last size printed in `outputs`."""
    sizes = [out for out in outputs if isinstance(out, bindings.PrintAllFunctionsSize)]
    return sum(count for _, count in sizes[-1].sizes) if sizes else 0


class NoAnswer(Exception):
    """A window that neither relates nor refutes: the op's verdict is unknown."""


class WindowLimitExceeded(NoAnswer):
    """A window's saturation outgrew its e-node or time limit."""


class ShapeConflict(NoAnswer):
    """A window's e-graph gives one tensor two sizes along a dim: something it united is not
    one value, so nothing it derived is used."""


@dataclass(frozen=True)
class WindowLimits:
    """What one window's saturation may use: e-nodes (the prelude's included) and seconds.
    Past `settle_nodes` e-nodes a window stops as soon as it has its answer (a window that grows
    so regroups sums of blocks without end); a settling window stops searching past
    `search_nodes` e-nodes and keeps what it found. A window that escalates to the inverses of
    its reshapes grows to four times its e-nodes or `escalate_nodes`, whichever is more (up to
    `search_nodes`): a small window finds the relation far out, a large one pays per e-node."""

    nodes: int = 5_000_000
    seconds: float = 600.0
    search_nodes: int = 300_000
    settle_nodes: int = 20_000
    escalate_nodes: int = 50_000


class EgglogSession:
    """Windows share one e-graph with the prelude loaded; each runs inside push/pop."""

    def __init__(self, iterations: int = 12, memoize: bool = True,
                 store: MemoStore | None = None, rank_families: bool = False,
                 context_parallel: bool = False, limits: WindowLimits = WindowLimits()) -> None:
        """`rank_families` runs the rank-family rules (for symmetric programs) instead of the
        per-rank ones; `context_parallel` also the rules of sequence chunks and blockwise
        attention, and then a window settles one iteration after `$y` first extracts to a
        relation (those rules regroup sums of blocks without end: the e-graph grows about
        tenfold per iteration past that point). A window past `limits` raises
        WindowLimitExceeded."""
        self.iterations = iterations
        self.settle = context_parallel
        self.limits = limits
        self.rulesets = ["lemmas", "ranks"] if rank_families else ["lemmas", "per_rank"]
        self.rulesets.append(context.RULESET if context_parallel else SLICE_ORDER_RULESET)
        self.memoize = memoize
        self.store = store
        # a window's answer depends on the rules run and how long: proofs are stored apart per
        # kind of session
        self.stored_kind = f"{'+'.join(self.rulesets)}:{iterations}"
        self.memo: dict[str, Outcome] = {}
        self.hits = 0
        self.misses = 0
        self.rule_matches = 0  # over every saturated window
        self.largest_egraph = 0  # e-nodes of the largest saturated window (prelude included)
        self._egraph = self._fresh()

    def _fresh(self) -> bindings.EGraph:
        egraph = bindings.EGraph()
        egraph.run_program(*egraph.parse_program(prelude([*self.rulesets, INVERSES_RULESET,
                                                                 INWARD_RULESET])))
        self._conflict_check = egraph.parse_program(f"(check (= (dimsize t d) {SIZE_CONFLICT}))")
        return egraph

    def saturate(self, program: str) -> Outcome:
        """Run a window (which binds `$y`) and extract `$y`; identical windows are looked up."""
        canonical, names = canonicalize(program)
        outcome = self.memo.get(canonical) or self._stored(canonical)
        if outcome is None:
            self.misses += 1
            outcome = self._run(canonical)
            if self.memoize:
                self.memo[canonical] = outcome
                if self.store is not None:
                    self.store.put(f"window:{self.stored_kind}", canonical,
                                   [outcome.term, outcome.same, outcome.leaf_aliases])
        else:
            self.hits += 1
        real = lambda n: names[int(n[1:])]  # noqa: E731
        return Outcome(_restore(outcome.term, names), tuple(real(n) for n in outcome.same),
                       tuple((real(a), real(b)) for a, b in outcome.leaf_aliases))

    def _stored(self, canonical: str) -> Outcome | None:
        if self.store is None or not self.memoize:
            return None
        value = self.store.get(f"window:{self.stored_kind}", canonical)
        if value is None:
            return None
        term, same, aliases = value
        return Outcome(term, tuple(same), tuple(tuple(pair) for pair in aliases))

    def holds(self, program: str, equalities: list[str]) -> bool:
        """Whether `$y` equals every term in `equalities` after saturating `program`."""
        egraph = self._egraph
        checks = egraph.parse_program("\n".join(f"(check (= $y {term}))" for term in equalities))

        def checked() -> bool:
            try:
                egraph.run_program(*checks)
            except Exception:  # egglog reports a failed check as an error
                return False
            return True

        egraph.run_program(*egraph.parse_program("(push)"))
        try:
            egraph.run_program(*_batched(egraph, program))
            self._saturate_escalating(egraph, checked)
            return checked()
        finally:
            self._pop()

    def _saturate_escalating(self, egraph: bindings.EGraph, settled: Callable[[], bool]) -> list:
        """Saturate; where that leaves the window unsettled, name the inverses of its reshapes
        (costly on every window, needed by few) and saturate again, up to four times the
        e-nodes it had (see WindowLimits). Past that or past `limits`, the window's answer is
        what it had without them. Context-parallel windows escalate too: with a batch of more
        than one, a rank's sequence chunk is interleaved with the batch in the rows a
        projection reads, and only the inverses of those reshapes bring its queries back."""
        outputs = self._saturate(egraph, settled, self.rulesets)
        nodes = _nodes(outputs)
        if nodes > self.limits.search_nodes or settled():
            return outputs
        outputs += egraph.run_program(*egraph.parse_program(f"(run {INVERSES_RULESET} 1)"))
        try:
            return outputs + self._saturate(egraph, settled, [*self.rulesets, INWARD_RULESET],
                                            stop_at=self._escalation_bound(nodes), before=nodes)
        except WindowLimitExceeded:
            return outputs

    def _escalation_bound(self, nodes: int) -> int:
        limits = self.limits
        return min(limits.search_nodes, max(4 * nodes, limits.escalate_nodes))

    def _saturate(self, egraph: bindings.EGraph, settled: Callable[[], bool],
                  rulesets: list[str], stop_at: int | None = None, before: int = 0) -> list:
        """Run the rulesets up to `iterations` times (stopping at a fixpoint) within `limits`;
        stop once `settled()` (the window has its answer) holds past `limits.settle_nodes`
        e-nodes. A settling session's window runs one more iteration once `settled()` holds and
        stops, and stops past `limits.search_nodes` e-nodes without it (nothing is concluded
        from that but what the e-graph shows: an unrelated op stays unrelated); any window stops
        past `stop_at` e-nodes. `before`: the e-nodes an earlier saturation left (its growth)."""
        runs = " ".join(f"(run {name})" for name in rulesets)
        step = egraph.parse_program(f"(run-schedule (seq {runs}))\n(print-size)")
        start, outputs, settling, previous = time.perf_counter(), [], False, 0.0
        for _ in range(self.iterations):
            began = time.perf_counter()
            *ran, size = egraph.run_program(*step)
            outputs += [*ran, size]
            nodes = _nodes([size])
            took = time.perf_counter() - began
            self._refuse_runaway(before, nodes, took, began - start, previous)
            before, previous = nodes, took
            grown = nodes > self.limits.settle_nodes
            answered = (self.settle or grown) and settled()  # one extraction per iteration
            if settling or (grown and answered) or stop_at is not None and nodes > stop_at:
                break
            if nodes > self.limits.nodes:
                raise WindowLimitExceeded(f"its e-graph grew past {self.limits.nodes} e-nodes")
            if time.perf_counter() - start > self.limits.seconds:
                raise WindowLimitExceeded(f"saturating it took over {self.limits.seconds:g} s")
            if not any(out.report.updated for out in ran if isinstance(out, bindings.RunScheduleOutput)):
                break
            if self.settle and nodes > self.limits.search_nodes:
                break  # what it found by now is the answer: a window that grows so is not settling
            settling = self.settle and answered
        self._refuse_conflicts(egraph)
        return outputs

    def _refuse_runaway(self, before: int, nodes: int, took: float, spent: float,
                        previous: float = 0.0) -> None:
        """Stop a window whose next iteration, growing as this one did, would pass `limits`: an
        e-graph that multiplies its size each iteration passes them inside one iteration, which
        cannot be interrupted (memory and time run out before the check after it). So does one
        whose iterations multiply their time at a steady size (measured: 1.6 s, 23 s, then 259 s
        for 4% more e-nodes; or 0.5 s, then 8.3 s while growing fourfold, then past 14 GiB), so an
        iteration of a second or more that took `pace` times the one before it (counted from a
        tenth of a second; not the first) is expected to be followed by one `pace` times longer
        again."""
        growth = nodes / before if before else 1.0
        pace = took / max(previous, 0.1) if took >= 1.0 and previous > 0 else 1.0
        if pace > 1.5 and spent + took * (1 + pace) > self.limits.seconds:
            raise WindowLimitExceeded(f"its iterations take {pace:.1f}x longer each and the next "
                                      f"would end past {self.limits.seconds:g} s")
        if growth <= 1.5:
            return
        if nodes * growth > self.limits.nodes:
            raise WindowLimitExceeded(f"its e-graph grows {growth:.1f}x per iteration and would "
                                      f"pass {self.limits.nodes} e-nodes")
        if spent + took * (1 + growth) > self.limits.seconds:
            raise WindowLimitExceeded(f"its e-graph grows {growth:.1f}x per iteration and would "
                                      f"take over {self.limits.seconds:g} s")

    def _refuse_conflicts(self, egraph: bindings.EGraph) -> None:
        try:
            egraph.run_program(*self._conflict_check)
        except Exception:  # egglog reports a failed check as an error: no conflict
            return
        raise ShapeConflict("its e-graph gives a tensor two sizes along one dim (a shape conflict)")

    def _run(self, program: str) -> Outcome:
        egraph = self._egraph
        egraph.run_program(*egraph.parse_program("(push)"))
        try:
            egraph.run_program(*_batched(egraph, program))
            extract = egraph.parse_program("(extract $y)")
            outputs = self._saturate_escalating(egraph, lambda: is_relational(parse(str(
                egraph.run_program(*extract)[-1]))))
            outputs += egraph.run_program(*egraph.parse_program("(print-size)\n(extract $y)"))
            self._measure(outputs)
            term = str(outputs[-1]).strip()
            sliced = _SLICED.findall(program) if _PARTIAL_REPLICA.search(program) else []
            names = list(dict.fromkeys(_LEAF.findall(term) + sliced))
            targets = " ".join(f'(target (dist "{n}") "{n}")' for n in names)
            probe = (f'(rule () ((target $y "$y") {targets}) :ruleset window)\n(run window 1)\n'
                     "(run probe 1)\n(print-function same 1000000)")
            pairs = _SAME.findall(str(egraph.run_program(*egraph.parse_program(probe))[-1]))
        finally:
            self._pop()
        same = tuple(dict.fromkeys(other for name, other in pairs if name == "$y"))
        aliases = tuple(dict.fromkeys((n, o) for n, o in pairs if n != "$y" and n != o))
        return Outcome(term, same, aliases)

    def _measure(self, outputs: list) -> None:
        for output in outputs:
            if isinstance(output, bindings.RunScheduleOutput):
                self.rule_matches += sum(output.report.num_matches_per_rule.values())
            elif isinstance(output, bindings.PrintAllFunctionsSize):
                self.largest_egraph = max(self.largest_egraph,
                                          sum(size for _, size in output.sizes))

    def _pop(self) -> None:
        try:
            self._egraph.run_program(*self._egraph.parse_program("(pop)"))
        except Exception:  # a failed command can leave the scope unbalanced: start afresh
            self._egraph = self._fresh()
