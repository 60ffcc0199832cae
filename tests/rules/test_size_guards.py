"""Rules that combine two operands fire only where both have one size along the dim they cut.

Found on a causally balanced context-parallel layout: rank 0's rows [0:2] and [6:8] of a rotary
table and the whole table agree on their first two rows, and `binary-slices` used to conclude
the product of the two unsliced (ill-typed) operands, from which slices past rank 0's rows
followed: an unsound equality."""
from __future__ import annotations

from egglog import bindings

from scalify.rules import prelude

OWN = '(dist "own")'  # 4 rows of a table along dim 0
TABLE = '(dist "table")'  # the whole table, 8 rows


def _egraph(*facts: str) -> bindings.EGraph:
    egraph = bindings.EGraph()
    egraph.run_program(*egraph.parse_program(prelude(())))
    egraph.run_program(*egraph.parse_program("\n".join(facts)))
    for _ in range(4):
        egraph.run_program(*egraph.parse_program("(run-schedule (run lemmas))"))
    return egraph


def _equal(egraph: bindings.EGraph, left: str, right: str) -> bool:
    try:
        egraph.run_program(*egraph.parse_program(f"(check (= {left} {right}))"))
    except bindings.EggSmolError:
        return False
    return True


def _product(own_rows: int) -> tuple[bindings.EGraph, str]:
    left, right = f"(slice {OWN} 0 0 2)", f"(slice {TABLE} 0 0 2)"
    egraph = _egraph(f"(set (dimsize {OWN} 0) {own_rows})", f"(set (dimsize {TABLE} 0) 8)",
                     f'(let $p (binary "mul" {left} {right}))')
    return egraph, f'(slice (binary "mul" {OWN} {TABLE}) 0 0 2)'


def test_binary_of_slices_of_different_sizes_is_not_moved_outside():
    egraph, moved = _product(own_rows=4)
    assert not _equal(egraph, "$p", moved)


def test_binary_of_slices_of_one_size_is_moved_outside():
    egraph, moved = _product(own_rows=8)
    assert _equal(egraph, "$p", moved)
