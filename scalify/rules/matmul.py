"""Matrix products split over batch, row and column shards; a contraction shard gives partial sums."""
from __future__ import annotations

from .base import Rule
from .examples import tensor

RANK = 3  # examples use batched [B, M, K] @ [B, K, N] products
B, M, K, N = 4, 5, 6, 3


def _left(dim: int, first: int):
    def example(gen, choice):
        shape = [B, M, K]
        a, b = list(shape), list(shape)
        a[dim], b[dim] = first, shape[dim] - first
        return {"a": tensor(gen, *a), "b": tensor(gen, *b), "d": dim, "na": first,
                "nb": shape[dim] - first, "y": tensor(gen, B, K, N), "r": RANK}
    return example


def _right(dim: int, first: int):
    def example(gen, choice):
        shape = [B, K, N]
        a, b = list(shape), list(shape)
        a[dim], b[dim] = first, shape[dim] - first
        return {"a": tensor(gen, *a), "b": tensor(gen, *b), "d": dim, "na": first,
                "nb": shape[dim] - first, "x": tensor(gen, B, M, K), "r": RANK}
    return example


def _aligned(left_dim: int, right_dim: int, first: int):
    """Operands split at the same point: `a|b` along `left_dim` of A, `x|y` along `right_dim` of B."""
    def example(gen, choice):
        left, right = _left(left_dim, first)(gen, choice), _right(right_dim, first)(gen, choice)
        return {**left, "x": right["a"], "y": right["b"], "e": right_dim}
    return example


def _broadcast(gen, choice):
    return {**_left(0, 1)(gen, choice), "z": tensor(gen, 1, K, N), "n": B}


def _broadcast_left(gen, choice):
    return {**_right(0, 1)(gen, choice), "z": tensor(gen, 1, M, K), "n": B}


def _psum(gen, choice):
    return {"a": tensor(gen, B, M, K), "b": tensor(gen, B, M, K), "y": tensor(gen, B, K, N),
            "x": tensor(gen, B, M, K), "c": tensor(gen, B, K, N), "e": tensor(gen, B, K, N),
            "r": RANK}


def _sliced(gen, choice):
    return {"x": tensor(gen, B, M, K), "w": tensor(gen, B, K, N + 4), "d": 2, "s": 1, "e": N + 1,
            "y": tensor(gen, B, K, N), "v": tensor(gen, B, M + 3, K), "r": RANK}


def _rows(gen, choice):
    """Activations `a` [P, Q, K] whose rows a 2-D product merges, and a weight `y` [K, N]."""
    return {"a": tensor(gen, 4, 3, K), "y": tensor(gen, K, N), "i": 3, "n": 4, "m": 3}


def _row_rules() -> list[Rule]:
    """A product on merged rows is the batched product on the unmerged activations (the same
    weight for every batch), so row layouts ([b, s] or [s, b], whole or sharded) meet."""
    return [
        Rule("matmul-merged-rows", "(matmul (merge a 0 i) y 2)",
             "(merge (matmul a (expand (unsqueeze y 0) 0 n) 3) 0 i)", _rows,
             when=("(= n (dimsize a 0))",)),
        # Batched products on merged batch dims ([b*h, s, d] from [b, h, s, d]) are the product
        # on the unmerged batch (the same batches pair up: both operands merge alike).
        Rule("matmul-merged-batch", "(matmul (merge a 0 i) (merge b 0 i) 3)",
             "(merge (matmul a b 4) 0 i)",
             lambda gen, c: {"a": tensor(gen, 2, 3, M, K), "b": tensor(gen, 2, 3, K, N), "i": 3}),
        # A weight gradient contracts merged rows ([s*b, m]^T @ [s*b, n]): the sum over the outer
        # dim of the per-slice contractions, so rows sharded on either merged dim meet.
        Rule("matmul-merged-contraction", "(matmul (transpose (merge a 0 i) 0 1) (merge b 0 i) 2)",
             '(squeeze (reduce "sum" (matmul (transpose a 1 2) b 3) 0) 0)',
             lambda gen, c: {"a": tensor(gen, 2, 3, M), "b": tensor(gen, 2, 3, N), "i": 3}),
        # A contraction over every row is the same in any row order ([s, b] rows or [b, s]).
        Rule("matmul-contraction-of-transposed-rows",
             "(matmul (transpose (merge (transpose a 0 1) 0 i) 0 1) (merge (transpose b 0 1) 0 i) 2)",
             "(matmul (transpose (merge a 0 j) 0 1) (merge b 0 j) 2)",
             lambda gen, c: {"a": tensor(gen, 2, 3, M), "b": tensor(gen, 2, 3, N), "i": 2, "j": 3},
             when=("(= j (dimsize a 1))",)),
        Rule("matmul-transposed-rows", "(matmul (transpose a 0 1) (expand (unsqueeze y 0) 0 m) 3)",
             "(transpose (matmul a (expand (unsqueeze y 0) 0 n) 3) 0 1)", _rows,
             when=("(= n (dimsize a 0))", "(= m (dimsize a 1))")),
    ]


def rules() -> list[Rule]:
    return [
        *_row_rules(),
        Rule("matmul-batch-aligned", "(matmul (concat a b d na nb) (concat x y d na nb) r)",
             "(concat (matmul a x r) (matmul b y r) d na nb)", _aligned(0, 0, 1),
             when=("(< d (- r 2))",)),
        Rule("matmul-batch-broadcast-right", "(matmul (concat a b d na nb) (expand z d n) r)",
             "(concat (matmul a (expand z d na) r) (matmul b (expand z d nb) r) d na nb)",
             _broadcast, when=("(< d (- r 2))",)),
        Rule("matmul-batch-broadcast-left", "(matmul (expand z d n) (concat a b d na nb) r)",
             "(concat (matmul (expand z d na) a r) (matmul (expand z d nb) b r) d na nb)",
             _broadcast_left, when=("(< d (- r 2))",)),
        Rule("matmul-rows", "(matmul (concat a b d na nb) y r)",
             "(concat (matmul a y r) (matmul b y r) d na nb)", _left(1, 2),
             when=("(= d (- r 2))",)),
        Rule("matmul-columns", "(matmul x (concat a b d na nb) r)",
             "(concat (matmul x a r) (matmul x b r) d na nb)", _right(2, 1),
             when=("(= d (- r 1))",)),
        Rule("matmul-contraction", "(matmul (concat a b d na nb) (concat x y e na nb) r)",
             "(psum (matmul a x r) (matmul b y r))", _aligned(2, 1, 2),
             when=("(= d (- r 1))", "(= e (- r 2))")),
        Rule("matmul-over-unsqueezes", "(matmul (unsqueeze x d) (unsqueeze y d) r)",
             "(unsqueeze (matmul x y (- r 1)) d)",
             lambda gen, c: {"x": tensor(gen, M, K), "y": tensor(gen, K, N), "d": 0, "r": 3},
             when=("(< d (- r 2))",)),
        Rule("matmul-psum-left", "(matmul (psum a b) y r)", "(psum (matmul a y r) (matmul b y r))",
             _psum),
        Rule("matmul-psum-right", "(matmul x (psum c e) r)", "(psum (matmul x c r) (matmul x e r))",
             _psum),
        Rule("matmul-sliced-columns", "(matmul x (slice w d s e) r)", "(slice (matmul x w r) d s e)",
             _sliced, when=("(= d (- r 1))",)),
        Rule("matmul-sliced-rows", "(matmul (slice v d s e) y r)", "(slice (matmul v y r) d s e)",
             lambda gen, c: {**_sliced(gen, c), "d": 1, "s": 2, "e": M + 2},
             when=("(= d (- r 2))",)),
    ]
