"""Context parallelism: ranks hold chunks of the sequence and merge attention over key blocks.

A rank holds some positions of the sequence (chunks from both ends, for causal balance), so
reference values are concatenations of slices of rank tensors; position-wise ops, masks and
rotary tables must follow those slices. For attention, a rank computes per key block the
block's output and its log-sum-exp and merges the blocks by rescaling (the online-softmax
merge). These rules bring both sides to one normal form: attention as
`exp(-lse) * (exp(scores) @ values)`, with sums over blocks associative and commutative, so
blocks merged in any order (ring order differs per rank) meet the reference's softmax over all
keys. They run in their own ruleset, only for programs that merge blocks (see `needed`).
"""
from __future__ import annotations

import math

import torch

from ..ir.graph import Graph
from .base import Rule
from .examples import concat_parts, tensor
from .families import BINARY_KEYS, LINEAR_UNARY_KEYS, POSITIVE_SCALE_KEYS

RULESET = "context"
ROWS = (2, 3)  # examples: [batch, queries, ...]


def needed(reference: Graph, ranks: list[Graph]) -> bool:
    """Whether the ranks merge log-sum-exps the reference never does: a `logaddexp`, or a
    log-sum-exp in a program whose reference has none (blockwise attention, however it is
    written: a ring of sends, gathered chunks, a library's context-parallel attention)."""
    def has(graph: Graph, op: str) -> bool:
        return any(node.op == op for node in graph)
    return any(has(graph, "logaddexp") for graph in ranks) or (
        not has(reference, "logsumexp") and any(has(graph, "logsumexp") for graph in ranks))


def _scaled(gen, choice):
    """A row scale `c` [2, 3, 1] and values `x`, `y` [2, 3, 5] it broadcasts over."""
    return {"c": tensor(gen, *ROWS, 1), "x": tensor(gen, *ROWS, 5), "y": tensor(gen, *ROWS, 5),
            "d": 2, "n": 5}


def _attention(batch: int):
    """Scores x [batch, 2 heads, 3 queries, 4 keys] and values v [batch, 2, 4 keys, 5]."""
    def example(gen, choice):
        return {"x": tensor(gen, batch, 2, 3, 4), "v": tensor(gen, batch, 2, 4, 5), "d": 3,
                "r": 3, "h": 2}
    return example


def _rescaled(gen, choice):
    return {"l": tensor(gen, *ROWS, 1), "m": tensor(gen, *ROWS, 1), "y": tensor(gen, *ROWS, 5)}


def _three(gen, choice):
    return {name: tensor(gen, *ROWS, 1) for name in "abc"} | choice


def _table(gen, choice):
    """Parts of [2, 3, 5] along dim 1 and a table [1, 3, 5] broadcast along dim 0."""
    return {**concat_parts(gen, (2, 3, 5), 1, 1), "y": tensor(gen, 1, 3, 5), "k": 0, "n": 2,
            **choice}


def _operand_and_concat(gen, choice):
    """A tensor x [2, 6, 5] and parts of [2, 6, 5] cut along dim 1 after 2."""
    return {"x": tensor(gen, 2, 6, 5), **concat_parts(gen, (2, 6, 5), 1, 2), **choice}


def _contraction(gen, choice):
    """Weights [2, 3, 6] cut along keys (dim 2) after 2, and values y [2, 6, 5]."""
    return {**concat_parts(gen, (2, 3, 6), 2, 2), "y": tensor(gen, 2, 6, 5), "r": 3, **choice}


def _squeezed_parts(squeezed: int):
    """Parts of a [6, 5] tensor with a size-1 dim inserted at `squeezed`, cut along the other
    dims' first after 2 (`c`: its index once squeezed)."""
    shape = (1, 6, 5) if squeezed == 0 else (6, 1, 5)
    cut = 1 if squeezed == 0 else 0

    def example(gen, choice):
        return {**concat_parts(gen, shape, cut, 2), "k": squeezed, "c": 0, **choice}
    return example


def _sliced_broadcast(gen, choice):
    return {"x": tensor(gen, 2, 6, 5), "z": tensor(gen, 2, 1, 5), "d": 1, "s": 1, "e": 4, "n": 3,
            "m": 6, **choice}


def _sliced_twice(gen, choice):
    return {"x": tensor(gen, 4, 6, 5), "d": 2, "s": 0, "e": 3, "k": 1, "s2": 1, "e2": 4}


_EXP_NEG = '(unary "exp" (unary "neg" {}))'
_LSE = '(reduce "logsumexp" x d)'


def _associative(head: str, key: str | None) -> list[Rule]:
    """Commutativity and associativity of a sum-like constructor (with commutativity, one
    regrouping reaches every grouping)."""
    op = (lambda a, b: f"({head} {a} {b})") if key is None else (
        lambda a, b: f'({head} "{key}" {a} {b})')
    name = key or head
    return [
        Rule(f"{name}-commutes", op("a", "b"), op("b", "a"), _three),
        Rule(f"{name}-associates-right", op(op("a", "b"), "c"), op("a", op("b", "c")), _three),
    ]


def _filled(gen, choice):
    """Rows `a` [2, 3, 1] and tensors `x`, `u` [2, 3, 5]; `m` a mask all true, `c` a fill of
    -inf like `a`, `z` zeros like `x`; `y` [2, 5, 4] and `w` [2, 5, 6] to multiply with."""
    return {"a": tensor(gen, *ROWS, 1), "x": tensor(gen, *ROWS, 5), "u": tensor(gen, *ROWS, 5),
            "m": torch.ones(*ROWS, 5, dtype=torch.bool), "c": torch.full((*ROWS, 1), -math.inf),
            "z": torch.zeros(*ROWS, 5), "y": tensor(gen, 2, 5, 4), "w": tensor(gen, 2, 5, 4),
            "d": 2, "r": 3, "f": "-inf", "v": "0.0", **choice}


def _blocks_rules() -> list[Rule]:
    """Blocks no rank computes: key blocks wholly in a query block's future, under a causal
    mask that is all true there (the mask's blocks are stated uniform by `verify/constants.py`),
    and a merge started from a log-sum-exp of -inf and an output of zeros. A fill of -inf has
    exponential zero; the log-sum-exp merge and the sum over blocks drop such a block."""
    return [
        Rule("masked-fill-under-true", "(masked_fill x m f)", "(fill x f)", _filled,
             when=('(uniform m "True")',)),
        Rule("masked-fill-under-false", "(masked_fill x m f)", "x",
             lambda gen, c: {**_filled(gen, c), "m": torch.zeros(*ROWS, 5, dtype=torch.bool)},
             when=('(uniform m "False")',)),
        Rule("exp-of-neg-inf-fill", '(unary "exp" (fill x "-inf"))', '(fill x "0.0")', _filled),
        Rule("positive-scale-of-neg-inf-fill", '(unary g (fill x "-inf"))', '(fill x "-inf")',
             _filled, when=("(positive_scale g)",), families={"g": POSITIVE_SCALE_KEYS}),
        Rule("logsumexp-of-neg-inf-fill", '(reduce "logsumexp" (fill x "-inf") d)',
             '(fill (reduce "logsumexp" x d) "-inf")', _filled),
        Rule("logaddexp-of-neg-inf", '(binary "logaddexp" a c)', "a", _filled,
             when=('(uniform c "-inf")',)),
        Rule("matmul-of-zero-fill", '(matmul (fill x "0.0") y r)', '(fill (matmul x y r) "0.0")',
             _filled),
        # A fill's value does not depend on its operand's, only on its shape: a fill of a block
        # no rank computes is a fill of one a rank does.
        Rule("fill-of-scaling", "(fill (unary g x) f)", "(fill x f)", _filled,
             when=("(linear_unary g)",), families={"g": LINEAR_UNARY_KEYS}),
        Rule("fill-of-masked-fill", "(fill (masked_fill x m v) f)", "(fill x f)", _filled),
        Rule("fill-of-unsqueeze", "(fill (unsqueeze x d) f)", "(unsqueeze (fill x f) d)", _filled),
        Rule("fill-of-matmul-of-same-columns", "(fill (matmul x y r) f)", "(fill (matmul x w r) f)",
             lambda gen, c: {**(env := _filled(gen, c)), "t": env["x"] @ env["w"]},
             when=("(= t (matmul x w r))", "(= (dimsize y (- r 1)) (dimsize w (- r 1)))"),
             trigger="(fill (matmul x y r) f)"),
        Rule("psum-with-zeros", "(psum u z)", "u", _filled, when=('(uniform z "0.0")',)),
        Rule("add-of-zeros-left", '(binary "add" z u)', "u", _filled, when=('(uniform z "0.0")',)),
        Rule("add-of-zeros-right", '(binary "add" u z)', "u", _filled, when=('(uniform z "0.0")',)),
        Rule("product-of-zeros-left", '(binary "mul" z u)', "z", _filled,
             when=('(uniform z "0.0")',)),
        Rule("product-of-zeros-right", '(binary "mul" u z)', "z", _filled,
             when=('(uniform z "0.0")',)),
        Rule("row-scale-of-zeros", "(bmul a z)", "z", _filled, when=('(uniform z "0.0")',)),
    ]


# Uniform values stay uniform under data movement; a fill is uniform, shaped as its operand.
FACT_RULES = tuple(
    f"(rule ((uniform u v) (= t ({term}))) ((uniform t v)) :ruleset {RULESET})"
    for term in ("expand u d n", "unsqueeze u d", "squeeze u d", "slice u d s e", "merge u d i",
                 "split u d i", "transpose u d e")) + (
    f"(rule ((= t (fill x v))) ((uniform t v)) :ruleset {RULESET})",
    f"(rule ((= t (fill x v)) (= n (dimsize x d))) ((set (dimsize t d) n)) :ruleset {RULESET})",
    f"(rule ((= t (fill x v)) (= n (ndim x))) ((set (ndim t) n)) :ruleset {RULESET})")


def rules() -> list[Rule]:
    return [
        Rule("mul-by-broadcast-left", '(binary "mul" (expand c d n) y)', "(bmul c y)", _scaled),
        Rule("mul-by-broadcast-right", '(binary "mul" y (expand c d n))', "(bmul c y)", _scaled),
        # softmax(x) @ v = exp(-lse(x)) * (exp(x) @ v): the unnormalised form blocks share,
        # for [batch, heads, queries, keys] products as torch runs them (batched over heads:
        # batch 1 squeezed, or batch and heads merged).
        Rule("attention-unnormalised",
             '(unsqueeze (matmul (squeeze (softmax "softmax" x d) 0) (squeeze v 0) r) 0)',
             f'(bmul {_EXP_NEG.format(_LSE)} '
             '(unsqueeze (matmul (squeeze (unary "exp" x) 0) (squeeze v 0) r) 0))',
             _attention(1), when=("(= d r)",)),
        Rule("attention-unnormalised-merged-heads",
             '(split (matmul (merge (softmax "softmax" x d) 0 h) (merge v 0 h) r) 0 h)',
             f'(bmul {_EXP_NEG.format(_LSE)} '
             '(split (matmul (merge (unary "exp" x) 0 h) (merge v 0 h) r) 0 h))',
             _attention(2), when=("(= d r)",)),
        # Chunks of values with batch and heads merged, side by side along the keys: one merge
        # of the chunks side by side (the form `attention-unnormalised-merged-heads` reads).
        Rule("merges-concat", "(concat (merge a 0 h) (merge b 0 h) d na nb)",
             "(merge (concat a b (+ d 1) na nb) 0 h)",
             lambda gen, c: {**concat_parts(gen, (2, 4, 6, 5), 2, 2), "h": 4, "d": 1, "na": 2,
                             "nb": 4},
             when=("(> d 0)",)),
        Rule("logsumexp-over-concat", '(reduce "logsumexp" (concat a b d na nb) d)',
             '(binary "logaddexp" (reduce "logsumexp" a d) (reduce "logsumexp" b d))',
             lambda gen, c: concat_parts(gen, (2, 3, 5), 2, 2)),
        # exp(l - m) * (exp(-l) * y) = exp(-m) * y: a block rescaled to the merged log-sum-exp.
        Rule("rescale-to-merged",
             f'(bmul (unary "exp" (binary "sub" l m)) (bmul {_EXP_NEG.format("l")} y))',
             f'(bmul {_EXP_NEG.format("m")} y)', _rescaled),
        Rule("common-row-scale", '(binary "add" (bmul c x) (bmul c y))', "(bmul c (psum x y))",
             _scaled),
        *_associative("psum", None),
        *_blocks_rules(),
        *_associative("binary", "logaddexp"),
        # A position-wise op on a concatenation and a table broadcast along another dim (a
        # mask or rotary table the ranks slice into their own blocks): on the table's slices.
        Rule("binary-over-concat-and-table", "(binary f (concat a b d na nb) (expand y k n))",
             "(concat (binary f a (expand (slice y d 0 na) k n)) "
             "(binary f b (expand (slice y d na (+ na nb)) k n)) d na nb)",
             _table, when=("(!= d k)",), families={"f": BINARY_KEYS}),
        Rule("binary-over-table-and-concat", "(binary f (expand y k n) (concat a b d na nb))",
             "(concat (binary f (expand (slice y d 0 na) k n) a) "
             "(binary f (expand (slice y d na (+ na nb)) k n) b) d na nb)",
             _table, when=("(!= d k)",), families={"f": BINARY_KEYS}),
        # A fill under a mask on a concatenation (the scores of key blocks): each block filled
        # under its slice of the mask.
        Rule("masked-fill-over-concat", "(masked_fill (concat a b d na nb) m f)",
             "(concat (masked_fill a (slice m d 0 na) f) (masked_fill b (slice m d na (+ na nb)) f) "
             "d na nb)",
             lambda gen, c: {**concat_parts(gen, (2, 3, 5), 2, 2),
                             "m": tensor(gen, 2, 3, 5) > 0, "f": "-inf"}),
        # A position-wise op on a tensor and a concatenation (a rank's table built from the
        # chunks it holds): on the tensor's slices at the concatenation's cut.
        Rule("binary-over-operand-and-concat", "(binary f x (concat a b d na nb))",
             "(concat (binary f (slice x d 0 na) a) (binary f (slice x d na (+ na nb)) b) d na nb)",
             _operand_and_concat, families={"f": BINARY_KEYS}),
        Rule("binary-over-concat-and-operand", "(binary f (concat a b d na nb) x)",
             "(concat (binary f a (slice x d 0 na)) (binary f b (slice x d na (+ na nb))) d na nb)",
             _operand_and_concat, families={"f": BINARY_KEYS}),
        # Attention weights cut along the keys (a rank's key chunks) against values cut
        # elsewhere (the chunks ranks hold): the product as a sum over the weights' cut.
        Rule("matmul-contraction-at-left-cut", "(matmul (concat a b d na nb) y r)",
             "(psum (matmul a (slice y (- r 2) 0 na) r) (matmul b (slice y (- r 2) na (+ na nb)) r))",
             _contraction, when=("(= d (- r 1))",)),
        # Squeezed chunks side by side as one squeeze (the form `attention-unnormalised` reads:
        # the reference's values related chunk by chunk).
        Rule("squeezes-concat-before", "(concat (squeeze a k) (squeeze b k) c na nb)",
             "(squeeze (concat a b c na nb) k)", _squeezed_parts(1), when=("(< c k)",)),
        Rule("squeezes-concat-after", "(concat (squeeze a k) (squeeze b k) c na nb)",
             "(squeeze (concat a b (+ c 1) na nb) k)", _squeezed_parts(0), when=("(>= c k)",)),
        Rule("binary-slice-and-broadcast", "(binary f (slice x d s e) (expand z d n))",
             "(slice (binary f x (expand z d m)) d s e)", _sliced_broadcast,
             when=("(= m (dimsize x d))",), families={"f": BINARY_KEYS}),
        Rule("binary-broadcast-and-slice", "(binary f (expand z d n) (slice x d s e))",
             "(slice (binary f (expand z d m) x) d s e)", _sliced_broadcast,
             when=("(= m (dimsize x d))",), families={"f": BINARY_KEYS}),
        Rule("slice-inside-expand", "(slice (expand x k n) d s e)", "(expand (slice x d s e) k n)",
             lambda gen, c: {"x": tensor(gen, 4, 1, 6), "k": 1, "n": 3, "d": 2, "s": 1, "e": 4},
             when=("(!= d k)",)),
        Rule("slice-inside-unsqueeze-before", "(slice (unsqueeze x k) d s e)",
             "(unsqueeze (slice x d s e) k)",
             lambda gen, c: {"x": tensor(gen, 4, 6), "k": 2, "d": 1, "s": 1, "e": 4},
             when=("(< d k)",)),
        Rule("slice-inside-unsqueeze-after", "(slice (unsqueeze x k) d s e)",
             "(unsqueeze (slice x (- d 1) s e) k)",
             lambda gen, c: {"x": tensor(gen, 4, 6), "k": 0, "d": 2, "s": 1, "e": 4},
             when=("(> d k)",)),
        # A slice passes a squeezed unit dim (a batch of one squeezed before a product).
        Rule("slice-inside-squeeze-before", "(slice (squeeze x k) d s e)",
             "(squeeze (slice x d s e) k)",
             lambda gen, c: {"x": tensor(gen, 4, 6, 1), "k": 2, "d": 1, "s": 1, "e": 4},
             when=("(< d k)",)),
        Rule("slice-inside-squeeze-after", "(slice (squeeze x k) d s e)",
             "(squeeze (slice x (+ d 1) s e) k)",
             lambda gen, c: {"x": tensor(gen, 1, 4, 6), "k": 0, "d": 1, "s": 1, "e": 4},
             when=("(<= k d)",)),
        Rule("squeeze-outside-slice-before", "(squeeze (slice x d s e) k)",
             "(slice (squeeze x k) d s e)",
             lambda gen, c: {"x": tensor(gen, 4, 6, 1), "k": 2, "d": 1, "s": 1, "e": 4},
             when=("(< d k)",)),
        Rule("squeeze-outside-slice-after", "(squeeze (slice x d s e) k)",
             "(slice (squeeze x k) (- d 1) s e)",
             lambda gen, c: {"x": tensor(gen, 1, 4, 6), "k": 0, "d": 2, "s": 1, "e": 4},
             when=("(< k d)",)),
        Rule("slices-commute", "(slice (slice x d s e) k s2 e2)", "(slice (slice x k s2 e2) d s e)",
             _sliced_twice, when=("(> d k)",)),
    ]
