"""Position-wise ops commute with a concatenation of their operands (micro-batches of one batch).

A rank that splits its batch into micro-batches computes each op on slices; these rules let a
reference op on the whole batch be the concatenation of the micro-batches' ops. They mirror the
rank-family row rules (ranks.py) for two explicit parts.
"""
from __future__ import annotations

import torch

from .base import Rule
from .examples import tensor
from .families import COMPARISONS, LAST_DIM_KEYS

SHAPE = (3, 4, 5)  # examples concatenate along dim 1, split after 1


def _ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=gen)


def _parts(make) -> dict:
    """Two parts `a`, `b` of SHAPE along dim 1 made by `make(*shape)`."""
    return {"a": make(3, 1, 5), "b": make(3, 3, 5), "d": 1, "na": 1, "nb": 3}


def _compare(gen, choice):
    return {**_parts(lambda *s: _ints(gen, *s)), "v": 1, **choice}


def _masked(gen, choice):
    masks = _parts(lambda *s: _ints(gen, *s) > 0)
    return {**_parts(lambda *s: tensor(gen, *s)), "m1": masks["a"], "m2": masks["b"], "v": "0.0",
            "u": tensor(gen, 3, 1, 5), "n": 4}


def _selected(gen, choice):
    conditions = _parts(lambda *s: _ints(gen, *s) > 0)
    others = _parts(lambda *s: tensor(gen, *s))
    return {**_parts(lambda *s: tensor(gen, *s)), "c1": conditions["a"], "c2": conditions["b"],
            "x": others["a"], "y": others["b"], "u": tensor(gen, 3, 1, 5),
            "w": tensor(gen, 3, 1, 5), "n": 4}


def _tokens(gen, choice):
    return {"a": tensor(gen, 1, 3, 5), "b": tensor(gen, 2, 3, 5), "g1": tensor(gen, 1, 3),
            "g2": tensor(gen, 2, 3), "t1": torch.randint(0, 5, (1, 3), generator=gen),
            "t2": torch.randint(0, 5, (2, 3), generator=gen), "d": 0, "na": 1, "nb": 2, "v": 5}


def _grads(gen, choice):
    return {"a": tensor(gen, 1, 3, 4), "b": tensor(gen, 2, 3, 4),
            "t1": torch.randint(0, 5, (1, 3), generator=gen),
            "t2": torch.randint(0, 5, (2, 3), generator=gen), "d": 0, "na": 1, "nb": 2, "v": 5}


def _regrouped(gen, choice):
    a, b, c = (tensor(gen, *SHAPE) for _ in range(3))
    return {"a": a, "b": b, "c": c, "s": a + b}


def _reshaped_rows(gen_shape: tuple[int, ...] = (2, 3)) -> list[Rule]:
    """A pick of each row's target (and its gradient, put back at the target) is row-wise:
    rows merged ([b*s, v]) alike with their targets give the merged picks; rows transposed
    ([s, b, v]) pick at the targets transposed."""
    def picks(gen, choice):
        return {"x": tensor(gen, *gen_shape, 5), "g": tensor(gen, *gen_shape),
                "t": torch.randint(0, 5, gen_shape, generator=gen), "v": 5, "d": 0, "e": 1,
                "i": gen_shape[1], "k": 2, "m": 1}

    def transposed(gen, choice):
        """Targets for the rows (and gradients) transposed."""
        return {**picks(gen, choice), "t": torch.randint(0, 5, gen_shape[::-1], generator=gen)}

    return [
        Rule("take-over-merged-rows", "(take (merge x d i) (merge t d i) m)",
             "(merge (take x t (+ m 1)) d i)", picks, when=("(< d m)",)),
        Rule("take-over-transposed-rows", "(take (transpose x d e) t k)",
             "(transpose (take x (transpose t d e) k) d e)", transposed,
             when=("(< d k)", "(< e k)")),
        Rule("untake-over-merged-rows", "(untake (merge g d i) (merge t d i) v m)",
             "(merge (untake g t v (+ m 1)) d i)", picks, when=("(< d m)",)),
        Rule("untake-over-transposed-rows", "(untake (transpose g d e) t v k)",
             "(transpose (untake g (transpose t d e) v k) d e)", transposed,
             when=("(< d k)", "(< e k)")),
    ]


def _pick(gen) -> dict:
    """Rows a [2, 3, 5] and a target class t [2, 3] for each."""
    return {"a": tensor(gen, 2, 3, 5), "t": torch.randint(0, 5, (2, 3), generator=gen), "k": 2,
            "n": 5}


def rules() -> list[Rule]:
    return [
        # A rank adding up its micro-batches' partial results (e.g. token counts).
        Rule("sum-of-two-parts", "(psum a b)", '(binary "add" a b)',
             lambda gen, c: {"a": tensor(gen, *SHAPE), "b": tensor(gen, *SHAPE)}),
        # The same where a sum over every rank's micro-batches lists one rank's parts first:
        # regrouped only where the rank adds them up itself (full associativity grows without end).
        Rule("sum-regroups-a-ranks-parts", "(psum a (psum b c))", "(psum s c)", _regrouped,
             when=('(= s (binary "add" a b))',)),
        Rule("compare-over-concat", "(cmp_int f (concat a b d na nb) v)",
             "(concat (cmp_int f a v) (cmp_int f b v) d na nb)", _compare,
             families={"f": COMPARISONS}),
        Rule("last-dim-op-over-concat", "(opaque1 f (concat a b d na nb))",
             "(concat (opaque1 f a) (opaque1 f b) d na nb)", lambda gen, c: {**_parts(
                 lambda *s: tensor(gen, *s)), **c}, when=("(last_dim f)", "(< (+ d 1) (ndim a))"),
             families={"f": LAST_DIM_KEYS}),
        # Along the last dim alone, so through reshapes of the dims before it (Megatron's
        # [s, b, h] tokens flattened into rows, a rank holding a batch share of each position).
        Rule("last-dim-op-over-merge", "(opaque1 f (merge x d i))", "(merge (opaque1 f x) d i)",
             lambda gen, c: {"x": tensor(gen, 3, 4, 2, 5), "d": 1, "i": 2, **c},
             when=("(last_dim f)", "(< (+ d 2) (ndim x))"), families={"f": LAST_DIM_KEYS}),
        Rule("last-dim-op-over-split", "(opaque1 f (split x d i))", "(split (opaque1 f x) d i)",
             lambda gen, c: {"x": tensor(gen, 3, 8, 5), "d": 1, "i": 2, **c},
             when=("(last_dim f)", "(< (+ d 1) (ndim x))"), families={"f": LAST_DIM_KEYS}),
        Rule("add-int-over-concat", "(add_int (concat a b d na nb) v)",
             "(concat (add_int a v) (add_int b v) d na nb)", _compare),
        Rule("masked-fill-over-concats", "(masked_fill (concat a b d na nb) (concat m1 m2 d na nb) v)",
             "(concat (masked_fill a m1 v) (masked_fill b m2 v) d na nb)", _masked),
        Rule("masked-fill-over-broadcast-and-concat",
             "(masked_fill (expand u d n) (concat m1 m2 d na nb) v)",
             "(concat (masked_fill (expand u d na) m1 v) (masked_fill (expand u d nb) m2 v) d na nb)",
             _masked),
        Rule("masked-fill-over-concat-and-broadcast",
             "(masked_fill (concat a b d na nb) (expand u d n) v)",
             "(concat (masked_fill a (expand u d na) v) (masked_fill b (expand u d nb) v) d na nb)",
             lambda gen, c: {**_masked(gen, c), "u": _ints(gen, 3, 1, 5) > 0}),
        Rule("where-over-concats", "(where3 (concat c1 c2 d na nb) (concat a b d na nb) (concat x y d na nb))",
             "(concat (where3 c1 a x) (where3 c2 b y) d na nb)", _selected),
        Rule("where-over-concat-and-broadcasts",
             "(where3 (concat c1 c2 d na nb) (expand u d n) (expand w d n))",
             "(concat (where3 c1 (expand u d na) (expand w d na)) "
             "(where3 c2 (expand u d nb) (expand w d nb)) d na nb)", _selected),
        # A mask per rank's heads selecting between a broadcast fill and per-rank heads (or
        # the other way round): the causal masks of scaled_dot_product_attention.
        Rule("where-over-concat-broadcast-concat",
             "(where3 (concat c1 c2 d na nb) (expand u d n) (concat x y d na nb))",
             "(concat (where3 c1 (expand u d na) x) (where3 c2 (expand u d nb) y) d na nb)",
             _selected),
        Rule("where-over-concat-concat-broadcast",
             "(where3 (concat c1 c2 d na nb) (concat x y d na nb) (expand w d n))",
             "(concat (where3 c1 x (expand w d na)) (where3 c2 y (expand w d nb)) d na nb)",
             _selected),
        # A mask broadcast over heads selecting between per-rank heads and a broadcast fill.
        Rule("where-over-broadcast-concat-broadcast",
             "(where3 (expand u d n) (concat a b d na nb) (expand w d n))",
             "(concat (where3 (expand u d na) a (expand w d na)) "
             "(where3 (expand u d nb) b (expand w d nb)) d na nb)",
             lambda gen, c: {**_selected(gen, c), "u": _ints(gen, 3, 1, 5) > 0}),
        # A loss as log-sum-exp minus the target's shifted logit is minus the target's
        # log-softmax (how a vocab-parallel loss picks it).
        Rule("shift-into-pick", '(binary "sub" c (take a t k))',
             '(unary "neg" (take (binary "sub" a (expand (unsqueeze c k) k n)) t k))',
             lambda gen, ch: {**_pick(gen), "c": tensor(gen, 2, 3)}, when=("(= n (dimsize a k))",)),
        Rule("take-over-concats", "(take (concat a b d na nb) (concat t1 t2 d na nb) k)",
             "(concat (take a t1 k) (take b t2 k) d na nb)", lambda gen, c: {**_tokens(gen, c), "k": 2},
             when=("(< d k)",)),
        Rule("untake-over-concats", "(untake (concat g1 g2 d na nb) (concat t1 t2 d na nb) v k)",
             "(concat (untake g1 t1 v k) (untake g2 t2 v k) d na nb)",
             lambda gen, c: {**_tokens(gen, c), "k": 2}, when=("(< d k)",)),
        # The same gradient for every row (a mean's 1/n) put at each row's target.
        Rule("untake-over-broadcast-and-concat",
             "(untake (expand z d n) (concat t1 t2 d na nb) v k)",
             "(concat (untake (expand z d na) t1 v k) (untake (expand z d nb) t2 v k) d na nb)",
             lambda gen, c: {**_tokens(gen, c), "z": tensor(gen, 1, 3), "n": 3, "k": 2},
             when=("(< d k)",)),
        *_reshaped_rows(),
        Rule("embedding-grad-over-concat-tokens",
             "(embedding_grad (concat a b d na nb) (concat t1 t2 d na nb) v)",
             '(binary "add" (embedding_grad a t1 v) (embedding_grad b t2 v))', _grads),
    ]
