"""Reductions and normalisations: split over other dims, partial results over the sharded dim."""
from __future__ import annotations

from .base import Rule
from .examples import concat_parts, tensor
from .families import NORMALIZATIONS, REDUCTIONS

SHAPE = (3, 4, 5)


def _other_dim(gen, choice):
    return {**concat_parts(gen, SHAPE, 1, 1), "k": 2, **choice}


def _same_dim(gen, choice):
    return concat_parts(gen, SHAPE, 2, 2)


def _sliced(gen, choice):
    return {"x": tensor(gen, *SHAPE), "d": 1, "s": 1, "e": 3, "k": 2, **choice}


def _psum_pieces(gen, choice):
    """Partial sums `a + b` and `x + y` that concatenate along dim 1."""
    return {"a": tensor(gen, 3, 1, 5), "b": tensor(gen, 3, 1, 5), "x": tensor(gen, 3, 3, 5),
            "y": tensor(gen, 3, 3, 5), "d": 1, "na": 1, "nb": 3}


def _transposed(k: int):
    return lambda gen, choice: {"x": tensor(gen, *SHAPE), "d": 0, "e": 2, "k": k, **choice}


def _over_transpose(head: str, families: dict) -> list[Rule]:
    """A reduction (or normalisation) of a transpose is the transpose of the reduction along
    the dim the transpose moved there (Megatron's [s, b, h] against a reference's [b, s, h])."""
    op = "reduce" if head == "reduce" else "softmax"
    return [
        Rule(f"{head}-over-transpose-other-dim", f"({op} f (transpose x d e) k)",
             f"(transpose ({op} f x k) d e)", _transposed(1), when=("(!= k d)", "(!= k e)"),
             families=families),
        Rule(f"{head}-over-transpose-first-dim", f"({op} f (transpose x d e) d)",
             f"(transpose ({op} f x e) d e)", _transposed(0), families=families),
        Rule(f"{head}-over-transpose-second-dim", f"({op} f (transpose x d e) e)",
             f"(transpose ({op} f x d) d e)", _transposed(2), families=families),
    ]


# How a reshape of adjacent dims moves the dims after it: (the reshape, the last dim it makes
# in its result, that dim's place in its operand, an operand and a later dim of the example).
_RESHAPES = {"merge": ("(merge x d i)", "d", "(+ k 1)", (2, 3, 4, 5), 2),
             "split": ("(split x d i)", "(+ d 1)", "(- k 1)", (2, 12, 5), 3)}


def _over_reshape(head: str, families: dict, reshape: str) -> list[Rule]:
    """A reduction (or normalisation) along a dim a merge keeps (or a split leaves whole) is
    the reshape of the reduction along that dim of its operand (rows merged to [b*s, v] beside
    [s, b, v]; a rank's rows split back into positions)."""
    op = "reduce" if head == "reduce" else "softmax"
    term, last, moved, shape, later = _RESHAPES[reshape]
    example = lambda k: lambda gen, c: {"x": tensor(gen, *shape), "d": 1, "i": 4, "k": k, **c}
    return [
        Rule(f"{head}-over-{reshape}-later-dim", f"({op} f {term} k)",
             f"({reshape} ({op} f x {moved}) d i)", example(later), when=(f"(> k {last})",),
             families=families),
        Rule(f"{head}-over-{reshape}-earlier-dim", f"({op} f {term} k)",
             f"({reshape} ({op} f x k) d i)", example(0), when=("(< k d)",), families=families),
    ]


def rules() -> list[Rule]:
    unsqueezed = lambda gen, c: {"x": tensor(gen, 3, 5), "d": 0, "k": 2, **c}
    return [
        *_over_transpose("reduce", {"f": REDUCTIONS}),
        *_over_transpose("normalize", {"f": NORMALIZATIONS}),
        *(rule for reshape in _RESHAPES for head, families in (("reduce", {"f": REDUCTIONS}),
                                                                ("normalize", {"f": NORMALIZATIONS}))
          for rule in _over_reshape(head, families, reshape)),
        Rule("reduce-over-unsqueeze", "(reduce f (unsqueeze x d) k)",
             "(unsqueeze (reduce f x (- k 1)) d)", unsqueezed, when=("(> k d)",),
             families={"f": REDUCTIONS}),
        Rule("reduce-over-unit-unsqueeze", "(reduce f (unsqueeze x d) d)", "(unsqueeze x d)",
             lambda gen, c: {"x": tensor(gen, 3, 5), "d": 1, **c}, families={"f": REDUCTIONS}),
        Rule("normalize-over-unsqueeze", "(softmax f (unsqueeze x d) k)",
             "(unsqueeze (softmax f x (- k 1)) d)", unsqueezed, when=("(> k d)",),
             families={"f": NORMALIZATIONS}),
        Rule("reduce-over-concat-other-dim", "(reduce f (concat a b d na nb) k)",
             "(concat (reduce f a k) (reduce f b k) d na nb)", _other_dim, when=("(!= d k)",),
             families={"f": REDUCTIONS}),
        Rule("sum-over-concat-dim", '(reduce "sum" (concat a b d na nb) d)',
             '(psum (reduce "sum" a d) (reduce "sum" b d))', _same_dim),
        # A bias gradient sums merged rows ([s*b, n]): the sum over both merged dims, so rows
        # sharded on either of them meet.
        Rule("sum-over-merged-dim", '(reduce "sum" (merge a d i) d)',
             '(squeeze (reduce "sum" (reduce "sum" a (+ d 1)) d) (+ d 1))',
             lambda gen, c: {"a": tensor(gen, 2, 3, 5), "d": 0, "i": 3}),
        # A sum over every row is the same in any row order ([s, b] rows or [b, s]).
        Rule("sum-over-transposed-rows", '(reduce "sum" (merge (transpose a 0 1) 0 i) 0)',
             '(reduce "sum" (merge a 0 j) 0)',
             lambda gen, c: {"a": tensor(gen, 2, 3, 5), "i": 2, "j": 3},
             when=("(= j (dimsize a 1))",)),
        # Sums that keep their dims may run in either order (a bias gradient over [b, s, n]).
        Rule("sums-commute", '(reduce "sum" (reduce "sum" a d) k)',
             '(reduce "sum" (reduce "sum" a k) d)',
             lambda gen, c: {"a": tensor(gen, 2, 3, 5), "d": 0, "k": 1}, when=("(!= d k)",)),
        Rule("amax-over-concat-dim", '(reduce "amax" (concat a b d na nb) d)',
             '(pmax (reduce "amax" a d) (reduce "amax" b d))', _same_dim),
        Rule("concat-of-psums", "(concat (psum a b) (psum x y) d na nb)",
             "(psum (concat a x d na nb) (concat b y d na nb))", _psum_pieces),
        Rule("sum-over-psum", '(reduce "sum" (psum a b) k)',
             '(psum (reduce "sum" a k) (reduce "sum" b k))',
             lambda gen, c: {"a": tensor(gen, *SHAPE), "b": tensor(gen, *SHAPE), "k": 1}),
        Rule("reduce-of-slice-other-dim", "(reduce f (slice x d s e) k)",
             "(slice (reduce f x k) d s e)", _sliced, when=("(!= d k)",),
             families={"f": REDUCTIONS}),
        Rule("normalize-of-slice-other-dim", "(softmax f (slice x d s e) k)",
             "(slice (softmax f x k) d s e)", _sliced, when=("(!= d k)",),
             families={"f": NORMALIZATIONS}),
        Rule("normalize-over-concat-other-dim", "(softmax f (concat a b d na nb) k)",
             "(concat (softmax f a k) (softmax f b k) d na nb)", _other_dim, when=("(!= d k)",),
             families={"f": NORMALIZATIONS}),
    ]
