"""Elementwise ops commute with concatenation; linear ones distribute over partial sums."""
from __future__ import annotations

import torch

from .base import Rule
from .examples import concat_parts, tensor
from .families import ADDITIVE, BINARY_KEYS, LINEAR_UNARY_KEYS, SCALES_LEFT, SCALES_RIGHT, UNARY_KEYS

SHAPE = (3, 4, 5)


def _concat_example(gen, choice):
    return {**concat_parts(gen, SHAPE, 1, 2), **choice}


def _aligned_example(gen, choice):
    left, right = concat_parts(gen, SHAPE, 1, 3), concat_parts(gen, SHAPE, 1, 3)
    return {**left, "x": right["a"], "y": right["b"], **choice}


def _broadcast_example(gen, choice):
    return {**concat_parts(gen, SHAPE, 1, 3), "z": tensor(gen, 3, 1, 5), "n": SHAPE[1], **choice}


def _psum_example(gen, choice):
    return {name: tensor(gen, *SHAPE) for name in "abxy"} | choice


def _shape_op_rules() -> list[Rule]:
    """Elementwise ops commute with the size-1 shape ops that relations may contain."""
    x3, y3 = (lambda gen: tensor(gen, 3, 1, 5)), (lambda gen: tensor(gen, 3, 1, 5))
    return [
        Rule("unary-over-unsqueeze", "(unary f (unsqueeze x d))", "(unsqueeze (unary f x) d)",
             lambda gen, c: {"x": tensor(gen, 3, 5), "d": 1, **c}, families={"f": UNARY_KEYS}),
        Rule("unary-over-squeeze", "(unary f (squeeze x d))", "(squeeze (unary f x) d)",
             lambda gen, c: {"x": x3(gen), "d": 1, **c}, families={"f": UNARY_KEYS}),
        Rule("unary-over-expand", "(unary f (expand x d n))", "(expand (unary f x) d n)",
             lambda gen, c: {"x": x3(gen), "d": 1, "n": 4, **c}, families={"f": UNARY_KEYS}),
        Rule("binary-over-unsqueezes", "(binary f (unsqueeze x d) (unsqueeze y d))",
             "(unsqueeze (binary f x y) d)",
             lambda gen, c: {"x": tensor(gen, 3, 5), "y": tensor(gen, 3, 5), "d": 1, **c},
             families={"f": BINARY_KEYS}),
        Rule("binary-over-squeezes", "(binary f (squeeze x d) (squeeze y d))",
             "(squeeze (binary f x y) d)",
             lambda gen, c: {"x": x3(gen), "y": y3(gen), "d": 1, **c}, families={"f": BINARY_KEYS}),
    ]


def _row_wise_rules() -> list[Rule]:
    """Ops that act on each position alone commute with a concatenation of all their operands
    (micro-batches of one rank, for instance)."""
    def ints(gen):
        return concat_parts(gen, (2, 6, 5), 1, 2) | {
            "a": torch.randint(-2, 3, (2, 2, 5), generator=gen),
            "b": torch.randint(-2, 3, (2, 4, 5), generator=gen)}

    def masked(gen, choice):
        env = _concat_example(gen, choice)
        masks = concat_parts(gen, SHAPE, 1, 2)
        return {**env, "m": masks["a"] > 0, "n": masks["b"] > 0, "v": "0.0"}

    def picked(gen, choice):
        return {"a": tensor(gen, 2, 3), "b": tensor(gen, 4, 3), "d": 0, "na": 2, "nb": 4, "k": 1,
                "x": torch.randint(0, 3, (2,), generator=gen),
                "y": torch.randint(0, 3, (4,), generator=gen)}

    return [
        Rule("compare-over-concat", "(cmp_int f (concat a b d na nb) v)",
             "(concat (cmp_int f a v) (cmp_int f b v) d na nb)",
             lambda gen, c: {**ints(gen), "v": 1, **c},
             families={"f": ("lt", "le", "gt", "ge", "eq", "ne")}),
        Rule("masked-fill-over-concats", "(masked_fill (concat a b d na nb) (concat m n d na nb) v)",
             "(concat (masked_fill a m v) (masked_fill b n v) d na nb)", masked),
        Rule("take-over-concats", "(take (concat a b d na nb) (concat x y d na nb) k)",
             "(concat (take a x k) (take b y k) d na nb)", picked, when=("(< d k)",)),
        Rule("masked-fill-over-broadcast-and-concat",
             "(masked_fill (expand u d n) (concat m k d na nb) v)",
             "(concat (masked_fill (expand u d na) m v) (masked_fill (expand u d nb) k v) d na nb)",
             lambda gen, c: {**masked(gen, c), "u": tensor(gen, 3, 1, 5), "k": masked(gen, c)["n"],
                             "n": SHAPE[1]}),
        Rule("where-over-concat-and-broadcasts",
             "(where3 (concat m k d na nb) (expand u d n) (expand w d n))",
             "(concat (where3 m (expand u d na) (expand w d na)) "
             "(where3 k (expand u d nb) (expand w d nb)) d na nb)",
             lambda gen, c: {**masked(gen, c), "k": masked(gen, c)["n"], "n": SHAPE[1],
                             "u": tensor(gen, 3, 1, 5), "w": tensor(gen, 3, 1, 5)}),
        Rule("untake-over-concats", "(untake (concat a b d na nb) (concat x y d na nb) v)",
             "(concat (untake a x v) (untake b y v) d na nb)",
             lambda gen, c: {**picked(gen, c), "a": tensor(gen, 2), "b": tensor(gen, 4), "v": 3}),
        Rule("embedding-grad-over-concat-tokens",
             "(embedding_grad (concat a b d na nb) (concat x y d na nb) v)",
             "(psum (embedding_grad a x v) (embedding_grad b y v))",
             lambda gen, c: {**picked(gen, c), "v": 3}),
    ]


def rules() -> list[Rule]:
    return [
        *_row_wise_rules(),
        Rule("unary-over-concat", "(unary f (concat a b d na nb))",
             "(concat (unary f a) (unary f b) d na nb)", _concat_example,
             families={"f": UNARY_KEYS}),
        Rule("linear-unary-over-psum", "(unary f (psum a b))", "(psum (unary f a) (unary f b))",
             _psum_example, when=("(linear_unary f)",), families={"f": LINEAR_UNARY_KEYS}),
        Rule("binary-over-aligned-concats", "(binary f (concat a b d na nb) (concat x y d na nb))",
             "(concat (binary f a x) (binary f b y) d na nb)", _aligned_example,
             families={"f": BINARY_KEYS}),
        Rule("binary-over-concat-and-broadcast", "(binary f (concat a b d na nb) (expand z d n))",
             "(concat (binary f a (expand z d na)) (binary f b (expand z d nb)) d na nb)",
             _broadcast_example, families={"f": BINARY_KEYS}),
        Rule("binary-over-broadcast-and-concat", "(binary f (expand z d n) (concat a b d na nb))",
             "(concat (binary f (expand z d na) a) (binary f (expand z d nb) b) d na nb)",
             _broadcast_example, families={"f": BINARY_KEYS}),
        *_shape_op_rules(),
        # Negated losses: -(a - b) = b - a, and negation keeps zero fills.
        Rule("negated-difference", '(unary "neg" (binary "sub" a b))', '(binary "sub" b a)',
             _psum_example),
        Rule("negation-over-zero-fill", '(unary "neg" (masked_fill x m "0.0"))',
             '(masked_fill (unary "neg" x) m "0.0")',
             lambda gen, c: {"x": tensor(gen, *SHAPE), "m": tensor(gen, *SHAPE) > 0}),
        # A partial sum is an addition (one way only: additions never become relations).
        Rule("psum-as-addition", "(psum a b)", '(binary "add" a b)', _psum_example),
        Rule("additive-over-psums", "(binary f (psum a b) (psum x y))",
             "(psum (binary f a x) (binary f b y))", _psum_example, when=("(additive f)",),
             families={"f": ADDITIVE}),
        Rule("scaling-over-psum-left", "(binary f (psum a b) y)",
             "(psum (binary f a y) (binary f b y))", _psum_example, when=("(scales_left f)",),
             families={"f": SCALES_LEFT}),
        Rule("scaling-over-psum-right", "(binary f x (psum a b))",
             "(psum (binary f x a) (binary f x b))", _psum_example, when=("(scales_right f)",),
             families={"f": SCALES_RIGHT}),
    ]
