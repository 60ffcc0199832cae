"""Elementwise ops commute with concatenation; linear ones distribute over partial sums."""
from __future__ import annotations

import torch

from .base import Rule
from .examples import concat_parts, tensor
from .families import (ADDITIVE, BINARY_KEYS, COMMUTATIVE, COMPARISONS, LINEAR_UNARY_KEYS, SCALES_LEFT,
                       SCALES_RIGHT, UNARY_KEYS, share_keys)
from .terms import evaluate, parse

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


def _bias_into_one_part(gen, choice):
    env = {**_psum_example(gen, choice), "u": tensor(gen, 3, 1, 5), "d": 1, "n": SHAPE[1]}
    return {**env, "z": env["a"] + env["u"].expand(SHAPE)}


HALF_PART = "(binary f a (unary h y))"


def _half_part_example(gen, choice):
    env = _psum_example(gen, choice)
    return {**env, "z": evaluate(parse(HALF_PART), env)}


HELD_SUM = '(binary "add" b c)'


def _regroup_example(gen, choice):
    env = {name: tensor(gen, *SHAPE) for name in "abc"}
    return {**env, "q": evaluate(parse(HELD_SUM), env)}


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
        # Index arithmetic and fills on a column of targets (DTensor's loss-parallel pick works
        # on `target.unsqueeze(1)`) are the same on the targets themselves.
        Rule("compare-over-unsqueeze", "(cmp_int f (unsqueeze t d) v)",
             "(unsqueeze (cmp_int f t v) d)", _targets, families={"f": COMPARISONS}),
        Rule("add-int-over-unsqueeze", "(add_int (unsqueeze t d) v)", "(unsqueeze (add_int t v) d)",
             _targets),
        # A range test on ids moved into local numbering (`ids - start < 0`) is a test on the
        # ids themselves (`ids < start`): nanotron and fairscale mask after shifting.
        Rule("compare-of-shifted", "(cmp_int f (add_int t o) v)", "(cmp_int f t (- v o))",
             lambda gen, c: {**_targets(gen, c), "o": -3}, families={"f": COMPARISONS}),
        Rule("masked-fill-over-unsqueezes", "(masked_fill (unsqueeze x d) (unsqueeze m d) f)",
             "(unsqueeze (masked_fill x m f) d)",
             lambda gen, c: {"x": tensor(gen, 3, 5), "m": tensor(gen, 3, 5) > 0, "d": 1,
                             "f": "0.0"}),
        Rule("masked-fill-over-merges", "(masked_fill (merge x d i) (merge m d i) f)",
             "(merge (masked_fill x m f) d i)",
             lambda gen, c: {"x": tensor(gen, 3, 4, 5), "m": tensor(gen, 3, 4, 5) > 0, "d": 1,
                             "i": 5, "f": "0.0"}),
        *_reshape_rules(),
    ]


def _targets(gen, choice):
    return {"t": torch.randint(-3, 9, (3, 5), generator=gen), "d": 1, "v": 4, **choice}


def _reshape_rules() -> list[Rule]:
    """Elementwise ops commute with reshapes (merges and splits of adjacent dims), so the same
    math on 2-D rows and on 3-D activations meets: a bias added before or after a view."""
    merged, split = (lambda gen: tensor(gen, 3, 4, 2, 5)), (lambda gen: tensor(gen, 3, 8, 5))
    return [
        Rule("unary-over-split", "(unary f (split x d i))", "(split (unary f x) d i)",
             lambda gen, c: {"x": split(gen), "d": 1, "i": 2, **c}, families={"f": UNARY_KEYS}),
        Rule("unary-over-merge", "(unary f (merge x d i))", "(merge (unary f x) d i)",
             lambda gen, c: {"x": merged(gen), "d": 1, "i": 2, **c}, families={"f": UNARY_KEYS}),
        # Equal results of one split (or merge) come from operands of one shape: well typed.
        Rule("binary-over-splits", "(binary f (split x d i) (split y d i))",
             "(split (binary f x y) d i)",
             lambda gen, c: {"x": split(gen), "y": split(gen), "d": 1, "i": 2, **c},
             families={"f": BINARY_KEYS}),
        Rule("binary-over-merges", "(binary f (merge x d i) (merge y d i))",
             "(merge (binary f x y) d i)",
             lambda gen, c: {"x": merged(gen), "y": merged(gen), "d": 1, "i": 2, **c},
             families={"f": BINARY_KEYS}),
        # A broadcast beside merged rows is the merge of a broadcast over the unmerged dims.
        Rule("binary-over-merge-and-broadcast", "(binary f (merge x d i) (expand z d n))",
             "(merge (binary f x (expand (expand (unsqueeze z d) d (/ n i)) (+ d 1) i)) d i)",
             lambda gen, c: {"x": merged(gen), "z": tensor(gen, 3, 1, 5), "d": 1, "i": 2, "n": 8,
                             **c},
             when=("(= (dimsize z d) 1)", "(> i 0)"), families={"f": BINARY_KEYS}),
        Rule("binary-over-broadcast-and-merge", "(binary f (expand z d n) (merge x d i))",
             "(merge (binary f (expand (expand (unsqueeze z d) d (/ n i)) (+ d 1) i) x) d i)",
             lambda gen, c: {"x": merged(gen), "z": tensor(gen, 3, 1, 5), "d": 1, "i": 2, "n": 8,
                             **c},
             when=("(= (dimsize z d) 1)", "(> i 0)"), families={"f": BINARY_KEYS}),
        # A row broadcast beside split rows (a gradient scaled per token on a [s, b, v] view
        # of [s * b, v] rows) is the split of the broadcast of the merged row; beside merged
        # or transposed rows, of the row merged or transposed alike.
        Rule("binary-over-split-and-row", "(binary f (split x d i) (expand (unsqueeze g k) k n))",
             "(split (binary f x (expand (unsqueeze (merge g d i) (- k 1)) (- k 1) n)) d i)",
             lambda gen, c: {"x": split(gen), "g": tensor(gen, 3, 4, 2), "d": 1, "i": 2, "k": 3,
                             "n": 5, **c},
             when=("(< (+ d 1) k)",), families={"f": BINARY_KEYS}),
        Rule("binary-over-merge-and-row",
             "(binary f (merge x d i) (expand (unsqueeze (merge g d i) k) k n))",
             "(merge (binary f x (expand (unsqueeze g (+ k 1)) (+ k 1) n)) d i)",
             lambda gen, c: {"x": merged(gen), "g": tensor(gen, 3, 4, 2), "d": 1, "i": 2, "k": 2,
                             "n": 5, **c},
             when=("(< d k)",), families={"f": BINARY_KEYS}),
        Rule("binary-over-transpose-and-row",
             "(binary f (transpose x d e) (expand (unsqueeze g k) k n))",
             "(transpose (binary f x (expand (unsqueeze (transpose g d e) k) k n)) d e)",
             lambda gen, c: {"x": tensor(gen, 3, 4, 5), "g": tensor(gen, 4, 3), "d": 0, "e": 1,
                             "k": 2, "n": 5, **c},
             when=("(< d k)", "(< e k)"), families={"f": BINARY_KEYS}),
        Rule("unary-over-transpose", "(unary f (transpose x d e))", "(transpose (unary f x) d e)",
             lambda gen, c: {"x": merged(gen), "d": 0, "e": 2, **c}, families={"f": UNARY_KEYS}),
        Rule("binary-over-transposes", "(binary f (transpose x d e) (transpose y d e))",
             "(transpose (binary f x y) d e)",
             lambda gen, c: {"x": merged(gen), "y": merged(gen), "d": 0, "e": 2, **c},
             families={"f": BINARY_KEYS}),
    ]


def _softmax_gradient_rules() -> list[Rule]:
    """A log-softmax's input gradient, `grad - (e / X(s)) * X(-g)` with X a row broadcast, in
    the form ranks compute it, `grad + X(g / s) * e` or `(e / X(s) - onehot) * X(g)`:
    negations move out of products, quotients and row broadcasts, a quotient by a row moves
    onto the row, and a row scale of a sum with a scatter scales each term."""
    def rows(gen, choice):
        return {"a": tensor(gen, 3, 5), "e": tensor(gen, 3, 5), "x": tensor(gen, 3, 5),
                "y": tensor(gen, 3, 5).abs() + 0.5, "g": tensor(gen, 3),
                "s": tensor(gen, 3, 1).abs() + 0.5, "d": 1, "n": 5}

    def scatters(gen, choice):
        return {"a": tensor(gen, 3, 5), "v": tensor(gen, 3), "g": tensor(gen, 3), "d": 1, "n": 5,
                "t": torch.randint(0, 5, (3,), generator=gen)}

    def negated(text: str) -> str:
        return f'(unary "neg" {text})'

    return [
        Rule("negation-out-of-row", f"(expand (unsqueeze {negated('g')} d) d n)",
             negated("(expand (unsqueeze g d) d n)"), rows),
        # (a constant -1 broadcast over the rows, torchtitan's `mask.float() - 1.0`)
        Rule("negation-out-of-broadcast", f"(expand {negated('s')} d n)",
             negated("(expand s d n)"), rows),
        Rule("negation-out-of-quotient", f'(binary "div" {negated("x")} y)',
             negated('(binary "div" x y)'), rows),
        Rule("negation-out-of-product-left", f'(binary "mul" {negated("x")} y)',
             negated('(binary "mul" x y)'), rows),
        Rule("negation-out-of-product-right", f'(binary "mul" x {negated("y")})',
             negated('(binary "mul" x y)'), rows),
        Rule("difference-of-negation", f'(binary "sub" a {negated("x")})', '(binary "add" a x)',
             rows),
        Rule("difference-as-sum", '(binary "sub" a x)', f'(binary "add" a {negated("x")})', rows),
        # The softmax as the exp of the log-softmax (DTensor's loss backward) is the exp over
        # its row sum (the sum of exps is positive, so its log is defined).
        Rule("exp-of-log-softmax", '(unary "exp" (binary "sub" a (expand (unary "log" s) d n)))',
             '(binary "div" (unary "exp" a) (expand s d n))', rows),
        # and the log of the softmax (Megatron's smoothed loss: `torch.log(softmax)`) is the
        # log-softmax, for a positive row sum s
        Rule("log-of-softmax", '(unary "log" (binary "div" (unary "exp" a) (expand s d n)))',
             '(binary "sub" a (expand (unary "log" s) d n))', rows),
        # A row scale of a sum with a scatter (Megatron's vocab-parallel loss backward scales
        # `softmax` minus its target's one by the tokens' gradients): each term scaled, the
        # scatter's values by the row's. Only over a scatter: a product distributed over every
        # sum multiplies the e-graph.
        Rule("row-scale-over-scatter-sum",
             '(binary "mul" (binary "add" a (untake v t n d)) (expand (unsqueeze g d) d n))',
             '(binary "add" (binary "mul" a (expand (unsqueeze g d) d n)) '
             '(untake (binary "mul" v g) t n d))', scatters),
        # Products with a zero fill and with ones (the fill `1 - mask.float()` is).
        Rule("product-of-zero-fill", '(binary "mul" (masked_fill x m "0.0") y)',
             '(masked_fill (binary "mul" x y) m "0.0")',
             lambda gen, c: {**rows(gen, c), "m": tensor(gen, 3, 5) > 0}),
        Rule("product-with-ones", '(binary "mul" u x)', "x",
             lambda gen, c: {**rows(gen, c), "u": torch.ones(3, 5)}, when=("(ones u)",)),
        Rule("quotient-times-row",
             '(binary "mul" (binary "div" e (expand s d n)) (expand (unsqueeze g d) d n))',
             '(binary "mul" (expand (unsqueeze (binary "div" g (squeeze s d)) d) d n) e)', rows),
    ]


def rules() -> list[Rule]:
    return [
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
        Rule("commute-operands", "(binary f x y)", "(binary f y x)", _psum_example,
             when=("(commutative f)",), families={"f": COMMUTATIVE}),
        # Gradients accumulated in another order (a residual's gradient added before or after
        # the norm's): a sum regrouped, only into a sum some program holds (regrouping every
        # sum reaches every grouping of long sums).
        Rule("sum-regrouped-as-held", '(binary "add" (binary "add" a b) c)', '(binary "add" a q)',
             _regroup_example, when=(f'(= q {HELD_SUM})',)),
        *_shape_op_rules(),
        *_softmax_gradient_rules(),
        # Negated losses: -(a - b) = b - a, and negation keeps zero fills.
        Rule("negated-difference", '(unary "neg" (binary "sub" a b))', '(binary "sub" b a)',
             _psum_example),
        Rule("negation-over-zero-fill", '(unary "neg" (masked_fill x m "0.0"))',
             '(masked_fill (unary "neg" x) m "0.0")',
             lambda gen, c: {"x": tensor(gen, *SHAPE), "m": tensor(gen, *SHAPE) > 0}),
        # A step scaled by a negative constant (`p.add_(g, alpha=-lr)`) against `p - lr * g`.
        Rule("scaling-of-negation", '(unary f (unary "neg" x))', '(unary "neg" (unary f x))',
             lambda gen, c: {"x": tensor(gen, *SHAPE), **c}, when=("(linear_unary f)",),
             families={"f": tuple(key for key in LINEAR_UNARY_KEYS if key != "neg")}),
        Rule("additive-over-psums", "(binary f (psum a b) (psum x y))",
             "(psum (binary f a x) (binary f b y))", _psum_example, when=("(additive f)",),
             families={"f": ADDITIVE}),
        # A bias added on one rank before the sum over ranks (vLLM's row-parallel layers add
        # it on rank 0 only): added to one part of the partial sum. Only a broadcast bias, and
        # only where that rank's sum exists: adding any y to every part of every partial sum
        # multiplies the e-graph, and a residual added on every rank to an unsummed partial
        # (a missing all_reduce) would relate past the add that should have summed it.
        Rule("bias-into-one-part", '(binary "add" (psum a b) (expand u d n))', "(psum z b)",
             _bias_into_one_part, when=('(= z (binary "add" a (expand u d n)))',)),
        # A value added to (or taken from) a partial sum of two parts, half to each part
        # (DTensor's Replicate operand of an add with a Partial one, over a group of two).
        # Only where a rank computed its part so: every sum of a psum and a value split in
        # halves multiplies the e-graph of a backward window (a gradient averaged over two).
        Rule("halves-into-parts", "(binary f (psum a b) y)",
             "(psum (binary f a (unary h y)) (binary f b (unary h y)))", _half_part_example,
             when=("(additive f)", "(halves h)", f"(= z {HALF_PART})"),
             families={"f": ADDITIVE, "h": tuple(sorted(share_keys(2)))}),
        Rule("scaling-over-psum-left", "(binary f (psum a b) y)",
             "(psum (binary f a y) (binary f b y))", _psum_example, when=("(scales_left f)",),
             families={"f": SCALES_LEFT}),
        Rule("scaling-over-psum-right", "(binary f x (psum a b))",
             "(psum (binary f x a) (binary f x b))", _psum_example, when=("(scales_right f)",),
             families={"f": SCALES_RIGHT}),
        # A zero fill is a product with the mask's complement (`ir/masks.py` writes such
        # products as fills): it passes a partial sum the same way.
        Rule("zero-fill-over-psum", '(masked_fill (psum a b) m "0.0")',
             '(psum (masked_fill a m "0.0") (masked_fill b m "0.0"))',
             lambda gen, c: {**_psum_example(gen, c), "m": tensor(gen, *SHAPE) > 0}),
    ]


# Ones (a constant of 1s, stated by windows: `verify/constants.py`) stay ones when broadcast.
FACT_RULES = tuple(f"(rule ((ones u) (= t ({term}))) ((ones t)) :ruleset lemmas)"
                   for term in ("expand u d n", "unsqueeze u d"))
