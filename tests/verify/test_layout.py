"""layout_term: the movement chain that lays a source out as an index map says, or none."""
from math import prod

import pytest
import torch

from scalify.rules.terms import App, evaluate
from scalify.verify.layout import layout_term

SOURCE = App("dist", ("x",))


def _laid(shape, move):
    ids = torch.arange(prod(shape)).reshape(shape)
    where = move(ids).contiguous()
    return layout_term(SOURCE, shape, where), ids, where


@pytest.mark.parametrize("shape, move", [
    ((2, 2, 4, 2, 4), lambda x: x.transpose(0, 1)),
    ((4, 8), lambda x: x[:, 2:6]),
    ((4, 8), lambda x: x.unsqueeze(1).expand(4, 3, 8)),
    ((2, 4, 6), lambda x: x.permute(2, 0, 1).reshape(6, 8)),
    ((2, 4, 6), lambda x: x[1, :, 3]),
    ((2, 1, 4), lambda x: x.reshape(2, 4, 1)),
    ((6, 4), lambda x: x.reshape(2, 3, 4).transpose(0, 1).reshape(3, 8)[:, ::2]),
    # Ulysses: [batch, heads, seq, dim] regrouped by rank blocks of heads
    ((2, 2, 2, 8, 4), lambda x: x.permute(1, 0, 2, 3, 4).reshape(2, 4, 8, 4)),
    ((2, 8, 4), lambda x: x),
])
def test_a_chain_is_found_and_equals_the_map(shape, move):
    term, ids, where = _laid(shape, move)
    assert term is not None
    assert torch.equal(evaluate(term, {"x": ids}), where)


@pytest.mark.parametrize("shape, move", [
    ((8,), lambda x: x.flip(0)),  # a reversal moves by a negative stride
    ((2, 8, 4), lambda x: x.reshape(2, 2, 4, 4).transpose(1, 2).reshape(4, 4, 4)[1:3]),
    ((6,), lambda x: x[torch.tensor([0, 1, 3])]),  # no fixed stride
])
def test_no_chain_for_maps_no_movement_makes(shape, move):
    term, _, _ = _laid(shape, move)
    assert term is None


def test_random_chains_are_exact_whenever_found():
    generator = torch.Generator().manual_seed(0)
    found = 0
    for _ in range(200):
        ids = torch.arange(48).reshape(2, 4, 6)
        x = ids
        for _ in range(3):
            step = int(torch.randint(4, (1,), generator=generator))
            if step == 0:
                x = x.transpose(0, x.dim() - 1)
            elif step == 1:
                x = x.reshape(-1, x.shape[-1])
            elif step == 2 and x.shape[0] > 1:
                x = x[1:]
            else:
                x = x.unsqueeze(0).expand(2, *x.shape)
        where = x.contiguous()
        term = layout_term(SOURCE, (2, 4, 6), where)
        if term is not None:
            found += 1
            assert torch.equal(evaluate(term, {"x": ids}), where)
    assert found > 100
