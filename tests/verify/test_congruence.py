"""Congruence under a rank concatenation: where a movement op puts the split dim is checked on
numbers (the op on the concatenation equals the concatenation of the op on each share)."""
import pytest
import torch

from scalify.ir.graph import Node
from scalify.ir.ops import OPS
from scalify.verify.congruence import _moved

WORLD = 3
SHARE = (2, 4, 1, 6)  # one rank's share; shares concatenate along the case's dim

CASES = [  # (op, attrs, split dim)
    ("slice", {"dim": 3, "start": 1, "end": 4}, 1),
    ("expand", {"dim": 2, "size": 5}, 1),
    ("pad", {"dim": 0, "before": 1, "after": 2, "value": 0.0}, 3),
    ("transpose", {"dim0": 1, "dim1": 3}, 1),
    ("transpose", {"dim0": 0, "dim1": 2}, 3),
    ("unsqueeze", {"dim": 1}, 1),
    ("unsqueeze", {"dim": 2}, 1),
    ("squeeze", {"dim": 2}, 3),
    ("squeeze", {"dim": 2}, 1),
    ("split", {"dim": 1, "inner": 2}, 1),
    ("split", {"dim": 3, "inner": 3}, 1),
    ("split", {"dim": 0, "inner": 2}, 3),
    ("merge", {"dim": 1, "inner": 1}, 1),
    ("merge", {"dim": 0, "inner": 4}, 3),
    ("merge", {"dim": 2, "inner": 6}, 0),
]


@pytest.mark.parametrize("op,attrs,dim", CASES, ids=[f"{op}-{a}-split{d}" for op, a, d in CASES])
def test_movement_moves_the_split_dim_where_congruence_says(op, attrs, dim):
    gen = torch.Generator().manual_seed(0)
    shares = [torch.randn(SHARE, generator=gen, dtype=torch.float64) for _ in range(WORLD)]
    node = Node("n", op, ("x",), tuple(sorted(attrs.items())), (), "float64")
    moved = _moved(node, dim, SHARE[dim])
    assert moved is not None
    out_dim, out_size = moved
    run = OPS[op].run
    whole = run([torch.cat(shares, dim)], attrs)
    pieces = [run([share], attrs) for share in shares]
    assert pieces[0].shape[out_dim] == out_size
    assert torch.equal(torch.cat(pieces, out_dim), whole)


@pytest.mark.parametrize("op,attrs,dim", [
    ("slice", {"dim": 1, "start": 0, "end": 2}, 1),
    ("expand", {"dim": 2, "size": 5}, 2),
    ("squeeze", {"dim": 2}, 2),
    ("merge", {"dim": 0, "inner": 4}, 1),  # the split dim is the inner one of the pair
], ids=["slice-of-split-dim", "expand-of-split-dim", "squeeze-of-split-dim", "merge-inner"])
def test_movement_across_the_split_dim_is_left_to_the_windows(op, attrs, dim):
    node = Node("n", op, ("x",), tuple(sorted(attrs.items())), (), "float64")
    assert _moved(node, dim, SHARE[dim]) is None
