"""Elementwise ops commute with concatenation; linear ones distribute over partial sums."""
from __future__ import annotations

from .base import Rule
from .examples import concat_parts, tensor
from .families import ADDITIVE, BINARY_KEYS, LINEAR_UNARY_KEYS, SCALES_LEFT, SCALES_RIGHT, UNARY_KEYS

SHAPE = (3, 4, 5)


def _concat_example(gen, choice):
    return {**concat_parts(gen, SHAPE, 1, 2), **choice}


def _binary_example(gen, choice):
    return {**concat_parts(gen, SHAPE, 1, 3), "y": tensor(gen, *SHAPE), "x": tensor(gen, *SHAPE),
            **choice}


def _psum_example(gen, choice):
    return {name: tensor(gen, *SHAPE) for name in "abxy"} | choice


def rules() -> list[Rule]:
    return [
        Rule("unary-over-concat", "(unary f (concat a b d na nb))",
             "(concat (unary f a) (unary f b) d na nb)", _concat_example,
             families={"f": UNARY_KEYS}),
        Rule("linear-unary-over-psum", "(unary f (psum a b))", "(psum (unary f a) (unary f b))",
             _psum_example, when=("(linear_unary f)",), families={"f": LINEAR_UNARY_KEYS}),
        Rule("binary-over-concat-left", "(binary f (concat a b d na nb) y)",
             "(concat (binary f a (slice y d 0 na)) (binary f b (slice y d na (+ na nb))) d na nb)",
             _binary_example, families={"f": BINARY_KEYS}),
        Rule("binary-over-concat-right", "(binary f x (concat a b d na nb))",
             "(concat (binary f (slice x d 0 na) a) (binary f (slice x d na (+ na nb)) b) d na nb)",
             _binary_example, families={"f": BINARY_KEYS}),
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
