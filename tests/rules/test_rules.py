"""Every rewrite rule, every template instance: both sides agree on random tensors."""
import pytest
import torch

from scalify.rules import all_rules
from scalify.rules.base import check_conditions, evaluate_sides
from scalify.rules.families import example_traits
from scalify.rules.terms import At, reads_dim_counts

CASES = [(rule, choice) for rule in all_rules() for choice in rule.instances()]


@pytest.mark.parametrize("rule,choice", CASES,
                         ids=[f"{r.name}[{','.join(c.values())}]" for r, c in CASES])
def test_rule_sides_agree_numerically(rule, choice):
    gen = torch.Generator().manual_seed(0)
    env = rule.example(gen, choice)
    for rank in range(rule.world):  # a term has one value per rank
        at = At(rank, rule.world)
        assert check_conditions(rule, env, example_traits(rule.world), at), "the example violates the rule's conditions"
        lhs, rhs = evaluate_sides(rule, env, at)
        assert lhs.shape == rhs.shape
        assert torch.allclose(lhs.double(), rhs.double(), rtol=1e-9, atol=1e-9, equal_nan=True)


def test_rule_names_are_unique():
    names = [rule.name for rule in all_rules()]
    assert len(names) == len(set(names))


def test_rules_reading_dim_counts_match_a_head_that_makes_windows_state_them():
    """Windows state dim counts only when they hold a head in NDIM_READERS: a rule that reads
    counts over any other head would never fire."""
    readers = [rule for rule in all_rules() if "(ndim " in " ".join(rule.when)]
    assert readers
    for rule in readers:
        assert reads_dim_counts(" ".join([rule.lhs, *rule.when])), rule.name
