"""Relation terms read in part: a rank tensor only some of whose elements a relation reads."""
from scalify.rules.terms import parse
from scalify.verify.relations import read_in_part

_SHAPES = {"a": (4, 8), "b": (4, 8)}


def test_a_tensor_read_through_a_slice_that_leaves_part_of_it_is_read_in_part():
    term = parse('(concat (slice (dist "a") 1 0 4) (slice (dist "b") 1 4 8) 1 4 4)')
    assert read_in_part(term, _SHAPES) == {"a", "b"}


def test_slices_that_cover_a_dim_together_read_the_whole_tensor():
    term = parse('(binary "add" (slice (dist "a") 1 0 4) (slice (dist "a") 1 4 8))')
    assert read_in_part(term, _SHAPES) == set()


def test_a_tensor_read_whole_anywhere_is_not_read_in_part():
    term = parse('(binary "add" (slice (dist "a") 1 0 4) (dist "a"))')
    assert read_in_part(term, _SHAPES) == set()
    assert read_in_part(parse('(dist "b")'), _SHAPES) == set()
