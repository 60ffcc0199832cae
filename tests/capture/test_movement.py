"""Chains of reshapes and transposes that keep element order are rewritten as one canonical
reshape that moves the same elements; two spellings of one reshape become the same nodes."""
from __future__ import annotations

import random

import pytest
import torch

from scalify.capture.movement import canonical_movement
from scalify.capture.tracer import capture
from scalify.ir.graph import Graph
from scalify.ir.ops import OPS


def _run(graph: Graph, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    values = dict(inputs)
    for node in graph:
        if node.op != "placeholder":
            values[node.name] = OPS[node.op].run([values[i] for i in node.inputs], dict(node.attrs))
    return [values[o] for o in graph.outputs]


class Moves(torch.nn.Module):
    def __init__(self, moves):
        super().__init__()
        self.moves = moves

    def forward(self, x):
        return self.moves(x).exp()


def _captured(moves, shape=(2, 3, 4)) -> tuple[Graph, torch.Tensor]:
    x = torch.randn(*shape)
    return capture(Moves(moves), lambda: Moves(moves)(x), {"x": x}), x


def _random_moves(seed: int):
    """A random chain of views, transposes, unit dims and flattens on a [2, 3, 4] tensor."""
    rng = random.Random(seed)

    def moves(x):
        for _ in range(6):
            choice = rng.randrange(5)
            if choice == 0 and x.dim() > 1:
                a, b = rng.sample(range(x.dim()), 2)
                x = x.transpose(a, b)
            elif choice == 1:
                x = x.unsqueeze(rng.randrange(x.dim() + 1))
            elif choice == 2:
                x = x.reshape(-1)
            elif choice == 3 and x.numel() % 6 == 0:
                x = x.reshape(6, -1) if rng.random() < 0.5 else x.reshape(-1, 2, 3)
            else:
                x = x.squeeze() if x.dim() > 1 else x
        return x
    return moves


@pytest.mark.parametrize("seed", range(40))
def test_the_canonical_chain_moves_the_same_elements(seed):
    graph, x = _captured(_random_moves(seed))
    (before,), (after,) = _run(graph, {"x": x}), _run(canonical_movement(graph), {"x": x})
    assert torch.equal(before, after)


def test_two_spellings_of_one_reshape_become_the_same_nodes():
    first, _ = _captured(lambda x: x.view(2, 12))
    second, _ = _captured(lambda x: x.unsqueeze(1).transpose(1, 2).unsqueeze(0).squeeze(0).flatten(1))
    ops = [[(n.op, n.attrs) for n in canonical_movement(g)] for g in (first, second)]
    assert ops[0] == ops[1]


def test_a_permutation_keeps_its_spelling():
    graph, _ = _captured(lambda x: x.transpose(0, 1).contiguous().view(3, 8))
    assert [n.op for n in canonical_movement(graph)] == [n.op for n in graph]


def test_a_round_trip_is_its_input():
    graph, _ = _captured(lambda x: x.transpose(1, 2).reshape(2, 12).view(2, 4, 3).transpose(1, 2))
    assert [n.op for n in canonical_movement(graph)] == ["placeholder", "exp"]


@pytest.mark.parametrize("shape, new", [((16, 16), (8, 8, 4)), ((4, 6), (6, 4)),
                                        ((2, 12, 5), (8, 3, 5)), ((2, 3, 4), (4, 6)),
                                        ((6, 4), (2, 12)), ((24,), (2, 3, 4)),
                                        ((2, 8, 48), (2, 8, 1, 6, 8)), ((2, 8, 1, 4, 8), (2, 8, 4, 8)),
                                        ((4, 1, 6), (1, 24)), ((6,), (1, 2, 1, 3, 1)),
                                        ((1, 2, 1, 3, 1), (6,))])
def test_a_reshape_across_dims_moves_the_same_elements(shape, new):
    graph, x = _captured(lambda x: x.reshape(new), shape)
    (got,) = _run(graph, {"x": x})
    assert torch.equal(got, x.reshape(new).exp())


def test_a_reshape_across_dims_splits_into_the_common_refinement():
    """[16, 16] -> [8, 8, 4] is [8, 2 | 4, 4] regrouped: each dim split, neighbours merged
    (the form relations through splits and merges follow), not all merged into 256 first."""
    graph, _ = _captured(lambda x: x.reshape(8, 8, 4), (16, 16))
    assert [(n.op, n.shape) for n in graph if n.op in ("merge", "split")] == [
        ("split", (8, 2, 16)), ("split", (8, 2, 4, 4)), ("merge", (8, 8, 4))]


def test_a_dim_of_one_per_rank_takes_the_reference_s_steps():
    """One kv head group per rank: the rank's [b, s, 48] -> [b, s, 1, 6, 8] splits as the
    reference's [b, s, 96] -> [b, s, 2, 6, 8] does (not a split then an unsqueeze)."""
    steps = lambda graph: [(n.op, n.attrs) for n in graph if n.op not in ("placeholder", "exp")]
    ours = [_captured(lambda x, new=new: x.reshape(new), shape)[0]
            for shape, new in (((2, 8, 48), (2, 8, 1, 6, 8)), ((2, 8, 96), (2, 8, 2, 6, 8)))]
    assert steps(ours[0]) == steps(ours[1])
