"""Data movement (merge/split/unsqueeze/squeeze/transpose/expand/slice) over concats and partial sums.

Every rule is size-free except where the concat's own part sizes say what a slice selects.
"""
from __future__ import annotations

import torch

from .base import Rule
from .examples import concat_parts, tensor
from .terms import evaluate, parse

SHAPE = (4, 6, 2, 3)


def _parts(dim: int, first: int, shape: tuple[int, ...] = SHAPE, **extra):
    def example(gen, choice):
        return {**concat_parts(gen, shape, dim, first), **extra}
    return example


def _concat_rule(name: str, op: str, attrs: str, new_dim: str, when: tuple[str, ...], example,
                 sizes: str = "na nb") -> Rule:
    return Rule(name, f"({op} (concat a b c na nb) {attrs})",
                f"(concat ({op} a {attrs}) ({op} b {attrs}) {new_dim} {sizes})", example, when=when)


def _with(dim: int, first: int, shape: tuple[int, ...] = SHAPE, **extra):
    """Concat parts along `dim` bound as `c`, plus the op's own attributes in `extra`."""
    def example(gen, choice):
        env = concat_parts(gen, shape, dim, first)
        env["c"] = env.pop("d")
        return {**env, **extra}
    return example


def _merged_groups(gen, choice):
    env = {"x": tensor(gen, 4, 3, 2, 5), "d": 1, "i": 2, "j": 1, "k": 2}
    return {**env, "m": evaluate(parse("(merge x d i)"), env)}


def _interchange(gen, choice):
    """Four blocks of a 2x2 grid: rows split after 1 along dim 0, columns after 2 along dim 1."""
    block = {"a": (1, 2), "b": (3, 2), "x": (1, 4), "y": (3, 4)}
    return {name: tensor(gen, *shape) for name, shape in block.items()} | {
        "d": 0, "na": 1, "nb": 3, "k": 1, "ma": 2, "mb": 4}


def _adjacent(gen, choice):
    x = tensor(gen, *SHAPE)
    return {"x": x, "d": 1, "a": 1, "b": 3, "c": 5, "na": 2, "nb": 2, "q": x.narrow(1, 3, 2)}


def _regroup(gen, choice):
    """Three parts along dim 1 and `x`, the concatenation of the first two."""
    a, b, c = tensor(gen, 3, 1), tensor(gen, 3, 2), tensor(gen, 3, 4)
    return {"a": a, "b": b, "c": c, "x": torch.cat([a, b], 1), "d": 1, "na": 1, "nb": 2, "nc": 4,
            "m": 6}


def _sliced(**extra):
    def example(gen, choice):
        return {"x": tensor(gen, 4, 6, 1, 3), "y": tensor(gen, 4, 6, 1, 3), **extra}
    return example


def _slice_rules() -> list[Rule]:
    """Elementwise and movement ops applied to a slice equal the slice of the op's result."""
    def outward(name, inner, outer, new_dim, when, example):
        return Rule(name, f"({inner.format(x='(slice x d s e)')})",
                    f"(slice ({outer}) {new_dim} s e)", example, when=when)
    return [
        outward("unsqueeze-slice-before", "unsqueeze {x} k", "unsqueeze x k", "d", ("(< d k)",),
                _sliced(d=1, s=2, e=5, k=2)),
        outward("unsqueeze-slice-after", "unsqueeze {x} k", "unsqueeze x k", "(+ d 1)",
                ("(>= d k)",), _sliced(d=1, s=2, e=5, k=1)),
        outward("squeeze-slice-before", "squeeze {x} k", "squeeze x k", "d", ("(< d k)",),
                _sliced(d=1, s=2, e=5, k=2)),
        outward("squeeze-slice-after", "squeeze {x} k", "squeeze x k", "(- d 1)", ("(> d k)",),
                _sliced(d=3, s=1, e=2, k=2)),
        outward("split-slice-before", "split {x} k i", "split x k i", "d", ("(< d k)",),
                _sliced(d=1, s=2, e=5, k=3, i=3)),
        outward("split-slice-after", "split {x} k i", "split x k i", "(+ d 1)", ("(> d k)",),
                _sliced(d=1, s=2, e=5, k=0, i=2)),
        outward("merge-slice-before", "merge {x} k i", "merge x k i", "d", ("(< d k)",),
                _sliced(d=1, s=2, e=5, k=2, i=3)),
        outward("merge-slice-after", "merge {x} k i", "merge x k i", "(- d 1)", ("(> d (+ k 1))",),
                _sliced(d=3, s=0, e=2, k=0, i=6)),
        outward("expand-slice", "expand {x} k n", "expand x k n", "d", ("(!= d k)",),
                _sliced(d=1, s=2, e=5, k=2, n=4)),
        outward("transpose-slice-first", "transpose {x} d2 e2", "transpose x d2 e2", "e2",
                ("(= d d2)",), _sliced(d=1, s=2, e=5, d2=1, e2=3)),
        outward("transpose-slice-second", "transpose {x} d2 e2", "transpose x d2 e2", "d2",
                ("(= d e2)",), _sliced(d=3, s=0, e=2, d2=1, e2=3)),
        outward("transpose-slice-other", "transpose {x} d2 e2", "transpose x d2 e2", "d",
                ("(!= d d2)", "(!= d e2)"), _sliced(d=1, s=2, e=5, d2=0, e2=3)),
        outward("unary-slice", "unary f {x}", "unary f x", "d", (),
                lambda gen, c: {**_sliced(d=1, s=2, e=5)(gen, c), "f": "exp"}),
        # Only for operands of one size along d: equal slices of a rank's own rows and of a
        # whole table are equal values, but the op on the unsliced operands is ill-typed.
        Rule("binary-slices", "(binary f (slice x d s e) (slice y d s e))",
             "(slice (binary f x y) d s e)",
             lambda gen, c: {**_sliced(d=1, s=2, e=5)(gen, c), "f": "add"},
             when=("(= (dimsize x d) (dimsize y d))",)),
    ]


# Every movement op: its attribute variables, an operand shape and attributes that fit it.
MOVEMENT_OPS = (
    ("merge", "d i", SHAPE, {"d": 1, "i": 2}), ("split", "d i", SHAPE, {"d": 1, "i": 3}),
    ("unsqueeze", "d", SHAPE, {"d": 2}), ("squeeze", "d", (4, 1, 3), {"d": 1}),
    ("transpose", "d e", SHAPE, {"d": 0, "e": 2}), ("expand", "d n", (4, 1, 3), {"d": 1, "n": 5}),
    ("slice", "d s e", SHAPE, {"d": 1, "s": 2, "e": 5}),
)


def _psum_rule(op: str, attrs: str, shape: tuple[int, ...], combine: str, **extra) -> Rule:
    """Data movement of a sum (or max) over two ranks' parts is that of the moved parts."""
    return Rule(f"{op}-over-{combine}", f"({op} ({combine} a b) {attrs})",
                f"({combine} ({op} a {attrs}) ({op} b {attrs}))",
                lambda gen, c: {"a": tensor(gen, *shape), "b": tensor(gen, *shape), **extra})


def rules() -> list[Rule]:
    return [
        _concat_rule("merge-concat-before", "merge", "d i", "c", ("(< c d)",), _with(0, 1, d=1, i=2)),
        _concat_rule("merge-concat-outer", "merge", "d i", "c", ("(= c d)",), _with(1, 2, d=1, i=2),
                     sizes="(* na i) (* nb i)"),
        _concat_rule("merge-concat-after", "merge", "d i", "(- c 1)", ("(> c (+ d 1))",),
                     _with(3, 1, d=1, i=2)),
        _concat_rule("split-concat-before", "split", "d i", "c", ("(< c d)",), _with(0, 3, d=1, i=3)),
        _concat_rule("split-concat-same", "split", "d i", "c",
                     ("(= c d)", "(= (% na i) 0)", "(= (% nb i) 0)"), _with(1, 4, d=1, i=2),
                     sizes="(/ na i) (/ nb i)"),
        _concat_rule("split-concat-after", "split", "d i", "(+ c 1)", ("(> c d)",),
                     _with(1, 2, d=0, i=2)),
        _concat_rule("unsqueeze-concat-before", "unsqueeze", "d", "c", ("(< c d)",), _with(1, 2, d=2)),
        _concat_rule("unsqueeze-concat-after", "unsqueeze", "d", "(+ c 1)", ("(>= c d)",),
                     _with(1, 2, d=1)),
        _concat_rule("squeeze-concat-before", "squeeze", "d", "c", ("(< c d)",),
                     _with(1, 2, shape=(4, 6, 1, 3), d=2)),
        _concat_rule("squeeze-concat-after", "squeeze", "d", "(- c 1)", ("(> c d)",),
                     _with(3, 1, shape=(4, 1, 2, 3), d=1)),
        _concat_rule("transpose-concat-first", "transpose", "d e", "e", ("(= c d)",),
                     _with(1, 2, d=1, e=3)),
        _concat_rule("transpose-concat-second", "transpose", "d e", "d", ("(= c e)",),
                     _with(3, 1, d=1, e=3)),
        _concat_rule("transpose-concat-other", "transpose", "d e", "c", ("(!= c d)", "(!= c e)"),
                     _with(0, 1, d=1, e=3)),
        _concat_rule("pad-concat-other", "pad", "d p q v", "c", ("(!= c d)",),
                     _with(1, 2, d=3, p=1, q=2, v="0.0")),
        _concat_rule("expand-concat", "expand", "d n", "c", ("(!= c d)",),
                     _with(1, 2, shape=(4, 6, 1, 3), d=2, n=5)),
        _concat_rule("slice-concat-other", "slice", "d s e", "c", ("(!= c d)",),
                     _with(1, 2, d=3, s=1, e=3)),
        Rule("slice-concat-first", "(slice (concat a b d na nb) d s e)", "(slice a d s e)",
             _parts(1, 4, s=1, e=3), when=("(<= e na)",)),
        Rule("slice-concat-second", "(slice (concat a b d na nb) d s e)",
             "(slice b d (- s na) (- e na))", _parts(1, 2, s=3, e=5), when=("(>= s na)",)),
        Rule("slice-concat-straddle", "(slice (concat a b d na nb) d s e)",
             "(concat (slice a d s na) (slice b d 0 (- e na)) d (- na s) (- e na))",
             _parts(1, 3, s=1, e=5), when=("(< s na)", "(> e na)")),
        # Adjacent slices of one tensor join (e.g. every rank's own block of a replicated
        # gradient); the second rule names the join wherever both slices exist.
        Rule("adjacent-slices-join", "(concat (slice x d a b) (slice x d b c) d na nb)",
             "(slice x d a c)", _adjacent),
        Rule("adjacent-slices-pair", "(slice x d a b)",
             "(slice (concat (slice x d a b) (slice x d b c) d (- b a) (- c b)) d 0 (- b a))",
             _adjacent, when=("(= q (slice x d b c))",)),
        Rule("partial-sum-from-slices", "(slice (psum a b) d s n)",
             "(concat (slice (psum a b) d s e) (slice (psum a b) d e n) d (- e s) (- n e))",
             lambda gen, c: {"a": tensor(gen, *SHAPE), "b": tensor(gen, *SHAPE), "d": 1, "s": 0,
                             "e": 2, "n": SHAPE[1]},
             when=("(= n (dimsize a d))", "(< e n)"), trigger="(slice (psum a b) d s e)"),
        Rule("slice-slice", "(slice (slice x d s e) d s2 e2)", "(slice x d (+ s s2) (+ s e2))",
             lambda gen, c: {"x": tensor(gen, *SHAPE), "d": 1, "s": 1, "e": 5, "s2": 1, "e2": 3}),
        # A slice inside the groups of a split picks a strided set of rows: peel one group off.
        Rule("slice-split-groups-peel", "(slice (split x d i) e s t)",
             "(concat (unsqueeze (slice x d s t) d) (slice (split (slice x d i n) d i) e s t) "
             "d 1 (- (/ n i) 1))",
             lambda gen, c: {"x": tensor(gen, 4, 6, 3), "d": 1, "i": 2, "n": 6, "e": 2, "s": 0, "t": 1},
             when=("(= e (+ d 1))", "(= (dimsize x d) n)", "(> n i)", "(<= t i)")),
        Rule("slice-split-one-group", "(slice (split x d i) e s t)", "(unsqueeze (slice x d s t) d)",
             lambda gen, c: {"x": tensor(gen, 4, 2, 3), "d": 1, "i": 2, "e": 2, "s": 1, "t": 2},
             when=("(= e (+ d 1))", "(= (dimsize x d) i)")),
        # One whole group of a merge (e.g. a rank's copy of the blocks a combine summed, in the
        # backward of that sum): the group's index of the unmerged dims.
        Rule("slice-merge-one-group", "(slice (merge x d i) d s e)",
             "(squeeze (slice x d (/ s i) (+ (/ s i) 1)) d)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 2, 5), "d": 1, "i": 2, "s": 2, "e": 4},
             when=("(= (- e s) i)", "(= (% s i) 0)")),
        # And back: a group taken by index where the merge is at hand is that merge's slice (a
        # weight cut in code and flattened to [gate | up] rows, read as gate and up apart).
        Rule("one-group-as-merge-slice", "(squeeze (slice x d j k) d)",
             "(slice (merge x d i) d (* j i) (* k i))",
             _merged_groups, when=("(= m (merge x d i))", "(= k (+ j 1))")),
        Rule("slice-whole", "(slice x d 0 n)", "x",
             lambda gen, c: {"x": tensor(gen, *SHAPE), "d": 1, "n": SHAPE[1]},
             when=("(= (dimsize x d) n)",)),
        Rule("slice-expand", "(slice (expand x d n) d s e)", "(expand x d (- e s))",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1, "n": 6, "s": 2, "e": 5}),
        Rule("concat-interchange", "(concat (concat a b d na nb) (concat x y d na nb) k ma mb)",
             "(concat (concat a x k ma mb) (concat b y k ma mb) d na nb)", _interchange,
             when=("(< d k)",)),
        Rule("split-whole-dim", "(split x d i)", "(unsqueeze x d)",
             lambda gen, c: {"x": tensor(gen, 4, 6), "d": 1, "i": 6},
             when=("(= (dimsize x d) i)",)),
        # Merges of disjoint dim pairs in either order are one reshape: the later pair merged
        # first ([s, b, n, d] to [s * b, n * d] either way).
        Rule("merges-later-first", "(merge (merge x d i) e j)", "(merge (merge x (+ e 1) j) d i)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4, 5), "d": 0, "i": 3, "e": 1, "j": 5},
             when=("(> e d)",)),
        # Three dims rotated ([s, b, n] to [b, n, s], a permute(1, 2, 0)) then the first two
        # merged: the merge, then the merged dim moved first (Megatron's values reshaped to
        # [s, b * n, d] and transposed, against a reference's permuted heads).
        Rule("merge-of-rotation", "(merge (transpose (transpose x a b) b c) a i)",
             "(transpose (merge x b i) a b)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4, 5), "a": 0, "b": 1, "c": 2, "i": 4},
             when=("(= b (+ a 1))", "(= c (+ a 2))")),
        # ... and back: a merged dim moved before the dim ahead of it is the rotation merged
        # (Megatron's queries [s, b, n, d] reshaped to [s, b * n, d] and transposed to the
        # batch of its product, against a reference's [b, n, s, d] merged).
        Rule("transposed-merge-as-rotation", "(transpose (merge x b i) a b)",
             "(merge (transpose (transpose x a b) b c) a i)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4, 5), "a": 0, "b": 1, "c": 2, "i": 4},
             when=("(= b (+ a 1))", "(= c (+ a 2))")),
        # A merge of two dims passes a unit dim on either side (a row's statistic kept as
        # [s, b, 1], its rows merged to [s * b, 1]).
        Rule("merge-over-unsqueeze-after", "(merge (unsqueeze x k) d i)",
             "(unsqueeze (merge x d i) (- k 1))",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4), "k": 2, "d": 0, "i": 3},
             when=("(> k (+ d 1))",)),
        Rule("merge-over-unsqueeze-before", "(merge (unsqueeze x k) d i)",
             "(unsqueeze (merge x (- d 1) i) k)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4), "k": 0, "d": 1, "i": 3},
             when=("(< k d)",)),
        # And a squeeze of a unit dim beside merged rows is the merge of the squeezed rows
        # (a row statistic kept as [b, s, 1], merged to [b * s, 1], then squeezed).
        Rule("squeeze-over-merge-after", "(squeeze (merge x d i) k)",
             "(merge (squeeze x (+ k 1)) d i)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 1), "k": 1, "d": 0, "i": 3},
             when=("(> k d)", "(= (dimsize x (+ k 1)) 1)")),
        Rule("squeeze-over-merge-before", "(squeeze (merge x d i) k)",
             "(merge (squeeze x k) (- d 1) i)",
             lambda gen, c: {"x": tensor(gen, 1, 2, 3), "k": 0, "d": 1, "i": 3},
             when=("(< k d)", "(= (dimsize x k) 1)")),
        Rule("merge-unit-dim", "(merge x d i)", "(squeeze x d)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 6), "d": 1, "i": 6},
             when=("(= (dimsize x d) 1)",)),
        Rule("squeeze-unsqueeze", "(squeeze (unsqueeze x d) d)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 3), "d": 1}),
        Rule("unsqueeze-squeeze", "(unsqueeze (squeeze x d) d)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1}),
        # Name the inverse of every unsqueeze, so facts about `(unsqueeze x d)` (e.g. how it is
        # tiled by rank blocks) reach `x` through the squeeze rules.
        Rule("unsqueeze-has-inverse", "(unsqueeze x d)", "(unsqueeze (squeeze (unsqueeze x d) d) d)",
             lambda gen, c: {"x": tensor(gen, 4, 3), "d": 1}),
        Rule("squeeze-lower-unit-dim", "(squeeze x e)", "(squeeze x d)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 1, 3), "d": 1, "e": 2},
             when=("(= e (+ d 1))", "(= (dimsize x d) 1)")),
        Rule("unsqueeze-beside-unit-dim", "(unsqueeze x d)", "(unsqueeze x (+ d 1))",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1}, when=("(= (dimsize x d) 1)",)),
        # A unit dim swapped with its neighbour is that unit dim inserted one place over.
        Rule("transpose-unit-dim-after", "(transpose (unsqueeze x d) d e)", "(unsqueeze x e)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "d": 1, "e": 2}, when=("(= e (+ d 1))",)),
        Rule("transpose-unit-dim-before", "(transpose (unsqueeze x e) d e)", "(unsqueeze x d)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "d": 1, "e": 2}, when=("(= e (+ d 1))",)),
        # Swapped with the dim two over, the unit dim lands there, and the dim between moves
        # first (ranks' tensors stacked on a new dim 0, then laid out with it at dim 2).
        Rule("transpose-unit-dim-two-over", "(transpose (unsqueeze x d) d e)",
             "(unsqueeze (transpose x d (+ d 1)) e)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "d": 0, "e": 2}, when=("(= e (+ d 2))",)),
        # A transpose of two other dims passes a unit dim (so unit dims from a view with one
        # head per rank, or from einsum, do not hide a transpose).
        Rule("transpose-over-unsqueeze-before", "(transpose (unsqueeze x k) d e)",
             "(unsqueeze (transpose x (- d 1) (- e 1)) k)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "k": 0, "d": 1, "e": 3},
             when=("(< k d)", "(< d e)")),
        Rule("transpose-over-unsqueeze-between", "(transpose (unsqueeze x k) d e)",
             "(unsqueeze (transpose x d (- e 1)) k)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "k": 1, "d": 0, "e": 3},
             when=("(< d k)", "(< k e)")),
        Rule("transpose-over-unsqueeze-after", "(transpose (unsqueeze x k) d e)",
             "(unsqueeze (transpose x d e) k)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 5), "k": 3, "d": 0, "e": 2},
             when=("(< d e)", "(< e k)")),
        # A unit dim squeezed from beside a transpose of two other dims passes it (a batch of
        # one squeezed before a batched product, [1, h, s, d] -> [h, s, d], transposed after).
        # A unit dim squeezed beside an inserted one: the squeeze first (ranks' tensors stacked
        # on a new dim, each with a unit batch dim the reference squeezes).
                        # A unit dim swapped with its neighbour and squeezed is that unit dim squeezed.
                                                # A unit dim squeezed from beside a transpose of two other dims passes it (a batch of
        # one squeezed before a batched product, [1, h, s, d] -> [h, s, d], transposed after).
        Rule("squeeze-over-transpose-before", "(squeeze (transpose x d e) k)",
             "(transpose (squeeze x k) (- d 1) (- e 1))",
             lambda gen, c: {"x": tensor(gen, 1, 3, 4, 5), "k": 0, "d": 1, "e": 3},
             when=("(< k d)", "(< d e)")),
        Rule("squeeze-over-transpose-between", "(squeeze (transpose x d e) k)",
             "(transpose (squeeze x k) d (- e 1))",
             lambda gen, c: {"x": tensor(gen, 3, 1, 4, 5), "k": 1, "d": 0, "e": 3},
             when=("(< d k)", "(< k e)")),
        Rule("squeeze-over-transpose-after", "(squeeze (transpose x d e) k)",
             "(transpose (squeeze x k) d e)",
             lambda gen, c: {"x": tensor(gen, 3, 4, 5, 1), "k": 3, "d": 0, "e": 2},
             when=("(< d e)", "(< e k)")),
        # A transpose of two dims on one side of a merge passes it (heads merged into the
        # batch of a batched product, [b*h, s, d], transposed to [b*h, d, s]).
        Rule("transpose-over-merge-after", "(transpose (merge x k i) d e)",
             "(merge (transpose x (+ d 1) (+ e 1)) k i)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 4, 5), "k": 0, "i": 3, "d": 1, "e": 2},
             when=("(< k d)", "(< d e)")),
        Rule("transpose-over-merge-before", "(transpose (merge x k i) d e)",
             "(merge (transpose x d e) k i)",
             lambda gen, c: {"x": tensor(gen, 4, 5, 2, 3), "k": 2, "i": 3, "d": 0, "e": 1},
             when=("(< d e)", "(< e k)")),
        # A broadcast along a dim a merge keeps passes the merge (a row max broadcast over the
        # classes of rows merged to [b*s, v]).
        Rule("expand-over-merge-later-dim", "(expand (merge x d i) k n)",
             "(merge (expand x (+ k 1) n) d i)",
             lambda gen, c: {"x": tensor(gen, 2, 3, 1), "d": 0, "i": 3, "k": 1, "n": 4},
             when=("(> k d)",)),
        Rule("expand-over-merge-earlier-dim", "(expand (merge x d i) k n)",
             "(merge (expand x k n) d i)",
             lambda gen, c: {"x": tensor(gen, 1, 2, 3), "d": 1, "i": 3, "k": 0, "n": 4},
             when=("(< k d)",)),
        Rule("unsqueeze-below-unit-dim", "(unsqueeze x d)", "(unsqueeze x (- d 1))",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 2},
             when=("(> d 0)", "(= (dimsize x (- d 1)) 1)")),
        Rule("concat-right-nested", "(concat (concat a b d na nb) c d m nc)",
             "(concat a (concat b c d nb nc) d na (+ nb nc))",
             lambda gen, c: {"a": tensor(gen, 3, 1), "b": tensor(gen, 3, 2), "c": tensor(gen, 3, 4),
                             "d": 1, "na": 1, "nb": 2, "m": 3, "nc": 4},
             when=("(= m (+ na nb))",)),
        # Associativity only towards groupings already present (a rank's own concat of its
        # pieces), so a flat chain of pieces finds the ranks' tensors without enumerating them all.
        Rule("concat-regroup", "(concat a (concat b c d nb nc) d na m)",
             "(concat x c d (+ na nb) nc)",
             _regroup,
             when=("(= x (concat a b d na nb))",)),
        Rule("squeeze-upper-unit-dim", "(squeeze x d)", "(squeeze x e)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 1, 3), "d": 1, "e": 2},
             when=("(= e (+ d 1))", "(= (dimsize x e) 1)")),
        Rule("expand-order", "(expand (expand x d n) e m)", "(expand (expand x e m) d n)",
             lambda gen, c: {"x": tensor(gen, 1, 1, 3), "d": 0, "n": 2, "e": 1, "m": 4},
             when=("(!= d e)",)),
        # A broadcast of a transpose is the transpose of the broadcast along the dim the
        # transpose moved there (a norm's mean broadcast over Megatron's [s, b, h]).
        Rule("expand-over-transpose-other-dim", "(expand (transpose x d e) k n)",
             "(transpose (expand x k n) d e)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 1), "d": 0, "e": 1, "k": 2, "n": 5},
             when=("(!= k d)", "(!= k e)")),
        Rule("expand-over-transpose-first-dim", "(expand (transpose x d e) d n)",
             "(transpose (expand x e n) d e)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 0, "e": 1, "n": 5}),
        Rule("expand-over-transpose-second-dim", "(expand (transpose x d e) e n)",
             "(transpose (expand x d n) d e)",
             lambda gen, c: {"x": tensor(gen, 1, 4, 3), "d": 0, "e": 1, "n": 5}),
        # Two unit dims swapped are the same tensor, so a value broadcast over both is also
        # the transpose of its broadcast in the other order (a norm's weight broadcast over
        # [b, s, h] beside one over Megatron's [s, b, h]).
        Rule("unit-dims-swapped", "u", "(transpose u d e)",
             lambda gen, c: {"u": tensor(gen, 1, 1, 3), "d": 0, "e": 1, "m": 2, "n": 4},
             when=("(< d e)", "(= (dimsize u d) 1)", "(= (dimsize u e) 1)"),
             trigger="(expand (expand u d m) e n)"),
        Rule("expand-to-one", "(expand x d 1)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1}),
        Rule("unsqueeze-order", "(unsqueeze (unsqueeze x d) e)", "(unsqueeze (unsqueeze x e) (+ d 1))",
             lambda gen, c: {"x": tensor(gen, 4, 6), "d": 1, "e": 0}, when=("(<= e d)",)),
        *_slice_rules(),
        *_reshape_rules(),
        *(_psum_rule(op, attrs, shape, combine, **example) for op, attrs, shape, example
          in MOVEMENT_OPS for combine in ("psum", "pmax")),
        *(_psum_inward(op, attrs, shape, combine, **example) for op, attrs, shape, example
          in MOVEMENT_OPS if op in SHAPE_DETERMINING for combine in ("psum", "pmax")),
    ]


# Movement ops whose result's shape determines their operand's: the same op on two operands
# with equal results has operands of one shape, so their sum is well typed.
SHAPE_DETERMINING = ("merge", "split", "unsqueeze", "squeeze", "transpose")


def _psum_inward(op: str, attrs: str, shape: tuple[int, ...], combine: str, **extra) -> Rule:
    """A sum (or max) over ranks of moved parts is the moved sum (an all_reduce after a view)."""
    return Rule(f"{combine}-of-{op}s", f"({combine} ({op} a {attrs}) ({op} b {attrs}))",
                f"({op} ({combine} a b) {attrs})",
                lambda gen, c: {"a": tensor(gen, *shape), "b": tensor(gen, *shape), **extra})


def _reshape_rules() -> list[Rule]:
    """Reshapes have inverses, and a broadcast split in two is a broadcast of a split: the
    relation between a reference's 2-D rows and a rank's 3-D activations (or the reverse)."""
    return [
        Rule("merge-split", "(merge (split x d i) d i)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 6, 3), "d": 1, "i": 2}),
        Rule("split-merge", "(split (merge x d i) d i)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 3, 2, 5), "d": 1, "i": 2}),
        Rule("transpose-twice", "(transpose (transpose x d e) d e)", "x",
             lambda gen, c: {"x": tensor(gen, 4, 6, 3), "d": 0, "e": 2}),
        Rule("broadcast-split", "(expand (expand (unsqueeze x d) d m) (+ d 1) i)",
             "(split (expand x d (* m i)) d i)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1, "m": 3, "i": 2},
             when=("(= (dimsize x d) 1)", "(> i 0)", "(> m 0)")),
        Rule("split-broadcast", "(split (expand x d n) d i)",
             "(expand (expand (unsqueeze x d) d (/ n i)) (+ d 1) i)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 3), "d": 1, "n": 6, "i": 2},
             when=("(= (dimsize x d) 1)", "(> i 0)", "(= (% n i) 0)")),
    ]


def inverse_rules() -> list[Rule]:
    """Every reshape and transpose names its inverse, so a value the ranks hold only reshaped is
    found. They double the e-graph of every window with reshapes, so they are their own ruleset,
    run only where a window finds no relation without them."""
    return [
        Rule("split-has-inverse", "(split x d i)", "(split (merge (split x d i) d i) d i)",
             lambda gen, c: {"x": tensor(gen, 4, 6, 3), "d": 1, "i": 2}),
        Rule("merge-has-inverse", "(merge x d i)", "(merge (split (merge x d i) d i) d i)",
             lambda gen, c: {"x": tensor(gen, 4, 3, 2, 5), "d": 1, "i": 2}),
        Rule("transpose-has-inverse", "(transpose x d e)",
             "(transpose (transpose (transpose x d e) d e) d e)",
             lambda gen, c: {"x": tensor(gen, 4, 6, 3), "d": 0, "e": 2}),
    ]


def inward_rules() -> list[Rule]:
    """A slice or split of an elementwise result is the op on the operands' slices or splits
    (the outward rules read the other way): a parameter's piece of a flat buffer updated whole
    (ZeRO-1 steps a flat partition, the parameters are read back out of it) is the update of
    that piece. They reach down every operand to its leaves, so they are their own ruleset,
    run only where a window finds no relation without them."""
    same = ("(= (dimsize x d) (dimsize y d))",)
    return [
        Rule("slice-into-unary", "(slice (unary f x) d s e)", "(unary f (slice x d s e))",
             lambda gen, c: {**_sliced(d=1, s=2, e=5)(gen, c), "f": "exp"}),
        Rule("slice-into-binary", "(slice (binary f x y) d s e)",
             "(binary f (slice x d s e) (slice y d s e))",
             lambda gen, c: {**_sliced(d=1, s=2, e=5)(gen, c), "f": "add"}, when=same),
        Rule("split-into-unary", "(split (unary f x) d i)", "(unary f (split x d i))",
             lambda gen, c: {**_sliced(d=1, i=3)(gen, c), "f": "exp"}),
        Rule("split-into-binary", "(split (binary f x y) d i)",
             "(binary f (split x d i) (split y d i))",
             lambda gen, c: {**_sliced(d=1, i=3)(gen, c), "f": "mul"}, when=same),
    ]


def slice_order_rules() -> list[Rule]:
    """Of two slices along different dims, the one along the lower dim outermost (a rank's
    chunk of a table built whole, then cut into its halves, is a slice of the reference's
    halves). Its own ruleset, run where the context rules are not: they put that slice
    innermost (to reach chunks of positions), and both orders at once cycle through every
    order of a nest of slices."""
    return [
        Rule("slice-slice-lower", "(slice (slice x d s e) k s2 e2)", "(slice (slice x k s2 e2) d s e)",
             _sliced(d=1, s=2, e=5, k=3, s2=1, e2=2), when=("(< d k)",)),
    ]


def per_rank_rules() -> list[Rule]:
    """Rules only the per-rank path needs (its own ruleset): there ranks may hold repeated kv
    chunks, a share of one kv head's copies, which halving the reference's repeat finds. The
    rank-family path never holds such chunks, and there the halves would meet
    `concat-parts-are-slices`, which cuts every run of copies into slices (16 query heads per kv
    head in Llama-3.1-405B: millions of matches per rotary window)."""
    return [
        Rule("repeat-halves", "(squeeze (expand u e n) d)",
             "(concat (squeeze (expand u e (/ n 2)) d) (squeeze (expand u e (/ n 2)) d) d (/ n 2) (/ n 2))",
             lambda gen, c: {"u": tensor(gen, 3, 1, 1, 5), "d": 1, "e": 2, "n": 4},
             when=("(= e (+ d 1))", "(= (dimsize u d) 1)", "(= (% n 2) 0)", "(>= n 2)")),
        # Two blocks side by side are the sum of each put at its place in zeros, where the
        # program pads them so (the backward of two ranks each taking its own block; the
        # rank-family path has `rank-blocks-in-zeros`). One rule per tensor rank and dim, each
        # requiring the blocks' sizes to agree in its other dims: pads of unrelated tensors
        # (a query's and a key's rotary halves) made ill-typed concats, shape conflicts.
        *(_blocks_in_zeros(rank, dim) for rank in range(1, 6) for dim in range(rank)),
        # Rank tensors stacked along a new dim, as element following lays them out: moved to
        # another dim, and merged with the dim after it, they are the tensors side by side
        # (classes split over ranks, as a vocab-parallel loss picks from them).
        Rule("stack-transposed", "(transpose (concat (unsqueeze a d) (unsqueeze b d) d 1 1) d e)",
             "(concat (transpose (unsqueeze a d) d e) (transpose (unsqueeze b d) d e) e 1 1)",
             lambda gen, c: {"a": tensor(gen, 3, 4, 5), "b": tensor(gen, 3, 4, 5), "d": 0, "e": 2}),
        Rule("stack-merged", "(merge (concat (unsqueeze a d) (unsqueeze b d) d 1 1) d i)",
             "(concat a b d i i)",
             lambda gen, c: {"a": tensor(gen, 3, 4, 5), "b": tensor(gen, 3, 4, 5), "d": 2, "i": 5},
             when=("(= i (dimsize a d))",)),
        # A rank tensor that is a concat (the backward of a rank's split of a fused projection)
        # names its parts as slices of it, so a reference value equal to one part finds it.
        # Only rank tensors: `concat-parts-are-slices` on every concat is the family path's.
        Rule("rank-concat-parts-are-slices", "(concat a b d na nb)",
             "(concat (slice (concat a b d na nb) d 0 na) "
             "(slice (concat a b d na nb) d na (+ na nb)) d na nb)", _rank_concat,
             when=("(= fired (concat a b d na nb))",), trigger="(dist n)"),
    ]


def _rank_concat(gen, choice):
    """Parts `a`, `b` along dim 1 and the rank tensor `n` (`fired`) that is their concat."""
    env = concat_parts(gen, SHAPE, 1, 2)
    whole = torch.cat([env["a"], env["b"]], 1)
    return {**env, "n": "whole", "whole": whole, "fired": whole}


def _blocks_in_zeros(rank: int, dim: int) -> Rule:
    """`blocks-in-zeros` for blocks of `rank` dims along `dim`."""
    shape = (4, 6, 2, 3, 5)[:rank]
    same = tuple(f"(= (dimsize a {e}) (dimsize b {e}))" for e in range(rank) if e != dim)

    def example(gen, choice):
        env = concat_parts(gen, shape, dim, 1)
        pad = [0, 0] * (rank - 1 - dim) + [1, 0]
        return {**env, "q": torch.nn.functional.pad(env["b"], pad)}

    return Rule(f"blocks-in-zeros-{rank}d-{dim}", f"(concat a b {dim} na nb)",
                f'(psum (pad a {dim} 0 nb "0.0") (pad b {dim} na 0 "0.0"))', example,
                when=(f'(= q (pad b {dim} na 0 "0.0"))', f"(= (dimsize a {dim}) na)",
                      f"(= (dimsize b {dim}) nb)", *same),
                trigger=f'(pad a {dim} 0 nb "0.0")')


# Shape facts the size-dependent rules read: a concat's parts have the sizes it records (its
# other dims its first part's), an unsqueezed dim has size 1, a partial sum has its parts'
# sizes, a slice's dim the size it selects, elementwise ops (operands broadcast explicitly)
# their operands' sizes, a rank concatenation and a merge the sizes they keep.
FACT_RULES = (
    "(rule ((= t (concat a b d na nb))) "
    "((set (dimsize a d) na) (set (dimsize b d) nb) (set (dimsize t d) (+ na nb))) :ruleset lemmas)",
    "(rule ((= t (concat a b d na nb)) (= n (dimsize a k)) (!= k d)) ((set (dimsize t k) n)) "
    ":ruleset lemmas)",
    "(rule ((= t (unsqueeze x d))) ((set (dimsize t d) 1)) :ruleset lemmas)",
    "(rule ((= t (psum a b)) (= n (dimsize a d))) ((set (dimsize t d) n)) :ruleset lemmas)",
    "(rule ((= t (slice x d s e))) ((set (dimsize t d) (- e s))) :ruleset lemmas)",
    "(rule ((= t (unary f x)) (= n (dimsize x d))) ((set (dimsize t d) n)) :ruleset lemmas)",
    "(rule ((= t (binary f x y)) (= n (dimsize x d))) ((set (dimsize t d) n)) :ruleset lemmas)",
    "(rule ((= t (binary f x y)) (= n (dimsize y d))) ((set (dimsize t d) n)) :ruleset lemmas)",
    # a rank concatenation holds every rank's part along its dim, its parts' sizes elsewhere
    "(rule ((= t (rcat x d s)) (= w (world))) ((set (dimsize t d) (* s w))) :ruleset lemmas)",
    "(rule ((= t (rcat x d s)) (= n (dimsize x k)) (!= k d)) ((set (dimsize t k) n)) "
    ":ruleset lemmas)",
    # a transpose swaps the sizes of its two dims and keeps the others
    "(rule ((= t (transpose x d e)) (= n (dimsize x e))) ((set (dimsize t d) n)) :ruleset lemmas)",
    "(rule ((= t (transpose x d e)) (= n (dimsize x d))) ((set (dimsize t e) n)) :ruleset lemmas)",
    "(rule ((= t (transpose x d e)) (= n (dimsize x k)) (!= k d) (!= k e)) "
    "((set (dimsize t k) n)) :ruleset lemmas)",
    # a merge of dims d and d+1 keeps the dims before d
    "(rule ((= t (merge x d i)) (= n (dimsize x k)) (< k d)) ((set (dimsize t k) n)) "
    ":ruleset lemmas)",
    # dim counts: kept by movement and elementwise ops, one more or one fewer by the reshapes
    *(f"(rule ((= t ({term})) (= n (ndim x))) ((set (ndim t) n)) :ruleset lemmas)"
      for term in ("slice x d s e", "transpose x d e", "expand x d s", "concat x y d a b",
                   "rcat x d s", "rslice x d s", "unary f x", "masked_fill x m f", "add_int x d",
                   "cmp_int f x d", "add_int_r x d s", "cmp_int_r f x d s")),
    *(f"(rule ((= t ({term})) (= n (ndim x))) ((set (ndim t) (+ n {step}))) :ruleset lemmas)"
      for term, step in (("unsqueeze x d", 1), ("split x d i", 1), ("squeeze x d", -1),
                         ("merge x d i", -1))),
)
