"""Embedding lookups over a vocab-sharded table, and the masked-lookup idiom of vocab parallelism;
likewise a loss's pick of the target's logit among a rank's classes.

`embed_range(w, ids, s)` is the lookup of `ids` in rows [s, s + rows(w)) of a larger table,
zero outside that range; `take_range(x, t, s, k)` is the pick of class `t` among the classes
[s, s + n) of a larger class dim that x's last dim `k` holds, zero outside. Reference ids and
targets are assumed to lie in [0, vocab).
"""
from __future__ import annotations

import torch

from .base import Rule
from .examples import tensor
from .terms import evaluate, parse

MASKED_LOOKUP = ('(masked_fill (embedding w (masked_fill (add_int ids o) m "0")) '
                 '(expand (unsqueeze m k) k h) "0.0")')


def _table(gen, choice):
    a, b = tensor(gen, 3, 4), tensor(gen, 5, 4)
    ids = torch.randint(0, 8, (2, 6), generator=gen)
    return {"a": a, "b": b, "na": 3, "nb": 5, "ids": ids, "s": 2}


def _table_shifted(gen, choice):
    env = _table(gen, choice)
    env["ids"] = torch.randint(0, 12, (2, 6), generator=gen)
    return env



def _columns(gen, choice):
    """A table of 5 rows cut after its second column; ids of two dims."""
    return {"a": tensor(gen, 5, 2), "b": tensor(gen, 5, 3), "na": 2, "nb": 3, "k": 2,
            "ids": torch.randint(0, 5, (2, 6), generator=gen)}


def _column_grads(gen, choice):
    """The lookups' gradient cut after its second column."""
    return {**_columns(gen, choice), "a": tensor(gen, 2, 6, 2), "b": tensor(gen, 2, 6, 3), "n": 5}


def _masked(gen, choice):
    w, ids, s = tensor(gen, 4, 3), torch.randint(0, 10, (2, 5), generator=gen), 2
    mask = (ids < s) | (ids >= s + 4)
    return {"w": w, "ids": ids, "s": s, "e": s + 4, "o": -s, "m": mask, "k": 2, "h": 3}


def _gradient(gen, choice):
    g, ids = tensor(gen, 2, 5, 3), torch.randint(0, 12, (2, 5), generator=gen)
    env = {"g": g, "ids": ids, "s": 4, "n": 4, "e": 8, "o": -4, "m": (ids < 4) | (ids >= 8),
           "k": 2, "h": 3, "na": 4, "nb": 4, "t": 8}
    return {**env, "q": evaluate(parse("(embed_grad_range g ids t nb)"), env)}


# vLLM's form of the range test: ids in [s, e) as `ge & lt`, the fill where it is off (its
# lookup of `mask * (ids - s)` is such a fill: `ir/masks.py`).
IN_RANGE = '(binary "bitwise_and" (cmp_int "ge" ids s) (cmp_int "lt" ids e))'
OUT_OF_RANGE = '(binary "bitwise_or" (cmp_int "lt" ids s) (cmp_int "ge" ids e))'


def _in_range(gen, choice):
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    return {"ids": ids, "s": 2, "e": 7}


def _short_range(gen, choice):
    """A table of 4 rows of which the range [s, e) uses the first 3 (padded rows past it)."""
    env = _masked(gen, choice)
    env["e"] = env["s"] + 3
    env["m"] = (env["ids"] < env["s"]) | (env["ids"] >= env["e"])
    return env


# torchtitan's form: the shifted ids clamped into the rank's rows (fills by `t < a` and
# `t > c`: capture/decompose.py), the rows the mask excludes zeroed after the lookup.
CLAMPED = ('(masked_fill (masked_fill (add_int ids o) (cmp_int "lt" (add_int ids o) a) f) '
           '(cmp_int "gt" (add_int ids o) c) g)')


def _clamped(gen, choice):
    return {**_masked(gen, choice), "a": 0, "c": 3, "f": "0", "g": "3"}


MASKED_PICK = '(masked_fill (take x (masked_fill (add_int t o) m "0") k) m "0.0")'


def _classes(gen, choice):
    """Logits of 2 x 5 tokens over 3 + 4 classes, targets over all 7."""
    return {"a": tensor(gen, 2, 5, 3), "b": tensor(gen, 2, 5, 4), "na": 3, "nb": 4, "k": 2,
            "s": 0, "t": torch.randint(0, 7, (2, 5), generator=gen)}


def _masked_pick(gen, choice):
    """A rank's 4 classes from class 3 on, targets over 10 classes."""
    t, s = torch.randint(0, 10, (2, 5), generator=gen), 3
    return {"x": tensor(gen, 2, 5, 4), "t": t, "s": s, "e": s + 4, "o": -s, "k": 2,
            "m": (t < s) | (t >= s + 4)}


GRAD_LOOKUP = ('(embedding_grad (masked_fill g (expand (unsqueeze m k) k h) "0.0") '
               '(masked_fill (add_int ids o) m "0") n)')


def rules() -> list[Rule]:
    return [
        Rule("embedding-over-concat-ids", "(embedding w (concat a b d na nb))",
             "(concat (embedding w a) (embedding w b) d na nb)",
             lambda gen, c: {"w": tensor(gen, 5, 4), "a": torch.randint(0, 5, (1, 6), generator=gen),
                             "b": torch.randint(0, 5, (2, 6), generator=gen), "d": 0, "na": 1,
                             "nb": 2}),
        Rule("embedding-of-sliced-ids", "(embedding w (slice ids d s e))",
             "(slice (embedding w ids) d s e)",
             lambda gen, c: {"w": tensor(gen, 5, 4), "ids": torch.randint(0, 5, (2, 6), generator=gen),
                             "d": 1, "s": 2, "e": 5}),
        # A table joined by columns: the lookups join along the lookup's last dim (one past
        # the ids' dims), and so do the gradients' columns.
        Rule("embedding-over-column-concat", "(embedding (concat a b 1 na nb) ids)",
             "(concat (embedding a ids) (embedding b ids) k na nb)", _columns,
             when=("(= k (ndim ids))",)),
        Rule("embedding-grad-over-column-concat", "(embedding_grad (concat a b k na nb) ids n)",
             "(concat (embedding_grad a ids n) (embedding_grad b ids n) 1 na nb)", _column_grads,
             when=("(= k (ndim ids))",)),
        # A lookup is position-wise over its ids: ids transposed ([s, b] of Megatron-style
        # code), their lookups transposed alike.
        Rule("lookup-of-transposed-ids", "(embedding w (transpose ids d e))",
             "(transpose (embedding w ids) d e)",
             lambda gen, c: {"w": tensor(gen, 5, 4), "d": 0, "e": 1,
                             "ids": torch.randint(0, 5, (2, 6), generator=gen)}),
        # Its gradient sums every token's row, in any order of the tokens.
        Rule("lookup-grad-of-transposed-rows", "(embedding_grad (transpose g d e) ids n)",
             "(embedding_grad g (transpose ids d e) n)",
             lambda gen, c: {"g": tensor(gen, 6, 2, 3), "d": 0, "e": 1, "n": 5,
                             "ids": torch.randint(0, 5, (2, 6), generator=gen)},
             when=("(< d (ndim ids))", "(< e (ndim ids))")),
        Rule("range-lookup-of-transposed-ids", "(embed_range w (transpose ids d e) s)",
             "(transpose (embed_range w ids s) d e)",
             lambda gen, c: {**_table_shifted(gen, c), "w": tensor(gen, 5, 4), "d": 0, "e": 1}),
        Rule("embedding-as-range", "(embedding w ids)", "(embed_range w ids 0)",
             lambda gen, c: {"w": tensor(gen, 5, 4), "ids": torch.randint(0, 5, (2, 6), generator=gen)}),
        Rule("embed-range-over-rows", "(embed_range (concat a b 0 na nb) ids s)",
             "(psum (embed_range a ids s) (embed_range b ids (+ s na)))", _table_shifted),
        Rule("masked-lookup", MASKED_LOOKUP, "(embed_range w ids s)", _masked,
             when=('(= m (binary "bitwise_or" (cmp_int "lt" ids s) (cmp_int "ge" ids e)))',
                   "(= o (- 0 s))", "(= e (+ s (dimsize w 0)))")),
        # A vocab-parallel loss: each rank picks the target's logit among its own classes
        # (zero elsewhere); the picks over adjacent class ranges sum to the pick over both.
        Rule("take-as-range", "(take x t k)", "(take_range x t 0 k)",
             lambda gen, c: {"x": tensor(gen, 2, 5, 4), "k": 2,
                             "t": torch.randint(0, 4, (2, 5), generator=gen)}),
        Rule("take-range-over-classes", "(take_range (concat a b k na nb) t s k)",
             "(psum (take_range a t s k) (take_range b t (+ s na) k))", _classes),
        Rule("pick-range-of-transposed-rows", "(take_range (transpose x d e) t s k)",
             "(transpose (take_range x (transpose t d e) s k) d e)",
             lambda gen, c: {"x": tensor(gen, 2, 5, 4), "s": 3, "k": 2, "d": 0, "e": 1,
                             "t": torch.randint(0, 10, (5, 2), generator=gen)},
             when=("(< d k)", "(< e k)")),
        Rule("masked-pick", MASKED_PICK, "(take_range x t s k)", _masked_pick,
             when=('(= m (binary "bitwise_or" (cmp_int "lt" t s) (cmp_int "ge" t e)))',
                   "(= o (- 0 s))", "(= e (+ s (dimsize x k)))")),
        # Where the clamp changes an id, the mask zeroes its row: the clamped lookup is the
        # masked one (its fills lie outside the rows [s, e) the mask keeps).
        Rule("clamped-lookup-under-its-mask",
             f'(masked_fill (embedding w {CLAMPED}) (expand (unsqueeze m k) k h) "0.0")',
             MASKED_LOOKUP, _clamped,
             when=(f"(= m {OUT_OF_RANGE})", "(= o (- 0 s))", "(<= a 0)", "(>= c (- (- e s) 1))")),
        Rule("out-of-range-is-not-in-range", f'(unary "bitwise_not" {IN_RANGE})', OUT_OF_RANGE,
             _in_range),
        # A range shorter than the rank's rows (a vocab padded past its end): the lookup uses
        # the rows before the padding only.
        Rule("masked-lookup-short-range", MASKED_LOOKUP, "(embed_range (slice w 0 0 (- e s)) ids s)",
             _short_range,
             when=('(= m (binary "bitwise_or" (cmp_int "lt" ids s) (cmp_int "ge" ids e)))',
                   "(= o (- 0 s))", "(> e s)", "(< e (+ s (dimsize w 0)))")),
        # Table gradients: each rank scatters the tokens of its rows [s, s + n); adjacent row
        # ranges join, and the range from 0 over every row is the whole gradient.
        Rule("masked-grad-lookup", GRAD_LOOKUP, "(embed_grad_range g ids s n)", _gradient,
             when=('(= m (binary "bitwise_or" (cmp_int "lt" ids s) (cmp_int "ge" ids e)))',
                   "(= o (- 0 s))", "(= e (+ s n))")),
        Rule("grad-ranges-pair", "(embed_grad_range g ids s na)",
             "(slice (concat (embed_grad_range g ids s na) q 0 na nb) 0 0 na)", _gradient,
             when=("(= t (+ s na))", "(= q (embed_grad_range g ids t nb))")),
        Rule("grad-ranges-join", "(concat (embed_grad_range g ids s na) q 0 na nb)",
             "(embed_grad_range g ids s (+ na nb))", _gradient,
             when=("(= t (+ s na))", "(= q (embed_grad_range g ids t nb))")),
        Rule("grad-range-whole", "(embed_grad_range g ids 0 n)", "(embedding_grad g ids n)",
             lambda gen, c: {"g": tensor(gen, 2, 5, 3), "n": 8,
                             "ids": torch.randint(0, 8, (2, 5), generator=gen)}),
    ]
