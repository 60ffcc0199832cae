"""The rule audit: every rule instance, on variants of its example, is sound numerically and
egglog reads its side conditions as Python does; planted wrong rules are caught."""
from dataclasses import replace

import pytest

from scalify.rules import all_rules
from scalify.rules.audit import audit, partial_families
from scalify.rules.base import Rule

CASES = [(rule, choice) for rule in all_rules() for choice in rule.instances()]


@pytest.mark.parametrize("rule,choice", CASES,
                         ids=[f"{r.name}[{','.join(c.values())}]" for r, c in CASES])
def test_rule_instance_passes_the_audit(rule, choice):
    result = audit(rule, choice)
    example = result.outcomes[0]
    assert example.holds and example.agree, "the example violates the rule or its sides differ"
    assert example.fired, "egglog does not fire the rule on its own example"
    assert not result.problems(), "\n".join(map(str, result.problems()))
    if rule.when:  # the conditions are exercised on both sides of their boundary
        assert result.violating > 0, "no variant violates the rule's conditions"


def test_a_family_no_condition_tests_covers_its_whole_kind():
    assert {rule.name: partial_families(rule) for rule in all_rules()
            if partial_families(rule)} == {}


def test_the_audit_catches_a_partial_family_without_its_trait_condition():
    """Commutativity written for add and mul but without `(commutative f)` would also swap the
    operands of sub in egglog."""
    unguarded = replace(_rule("commute-operands"), when=())
    assert partial_families(unguarded) == ["f"]


def _rule(name: str) -> Rule:
    return next(rule for rule in all_rules() if rule.name == name)


class _LooseEncoding(Rule):
    """A rule whose egglog text reads `(<= d k)` where Python reads `(< d k)`."""

    def egglog(self, ruleset: str) -> str:
        return super().egglog(ruleset).replace("(< d k)", "(<= d k)")


def test_the_audit_catches_a_dropped_condition():
    rule = _rule("slice-concat-first")
    assert any(o.unsound for o in audit(replace(rule, when=()), {}).outcomes)


def test_the_audit_catches_an_off_by_one_condition():
    rule = _rule("unsqueeze-slice-after")
    assert rule.when == ("(>= d k)",)
    wrong = replace(rule, when=("(>= d (- k 1))",))
    assert any(o.unsound and o.holds for o in audit(wrong, {}).outcomes)


def test_the_audit_catches_an_egglog_encoding_that_differs_from_python():
    rule = _rule("unsqueeze-slice-before")
    loose = _LooseEncoding(**vars(rule))
    outcomes = audit(loose, {}).outcomes
    assert any(o.mismatch for o in outcomes)
    assert any(o.unsound and not o.holds and o.fired for o in outcomes)
