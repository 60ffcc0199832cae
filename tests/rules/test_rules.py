"""Every rewrite rule, every template instance: both sides agree on random tensors."""
import pytest
import torch

from scalify.rules import all_rules
from scalify.rules.base import check_conditions, evaluate_sides
from scalify.rules.families import FACTS

CASES = [(rule, choice) for rule in all_rules() for choice in rule.instances()]


@pytest.mark.parametrize("rule,choice", CASES,
                         ids=[f"{r.name}[{','.join(c.values())}]" for r, c in CASES])
def test_rule_sides_agree_numerically(rule, choice):
    gen = torch.Generator().manual_seed(0)
    env = rule.example(gen, choice)
    assert check_conditions(rule, env, FACTS), "the example does not satisfy the rule's conditions"
    lhs, rhs = evaluate_sides(rule, env)
    assert lhs.shape == rhs.shape
    assert torch.allclose(lhs.double(), rhs.double(), rtol=1e-9, atol=1e-9, equal_nan=True)


def test_rule_names_are_unique():
    names = [rule.name for rule in all_rules()]
    assert len(names) == len(set(names))
