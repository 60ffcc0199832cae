"""Rank-family rules: one symbolic program stands for every rank (rank symmetry).

A term denotes one value per rank. `(rcat x d s)` concatenates every rank's `x` along `d` (each
of size `s`), `(rsum x)` / `(rmax x)` reduce over ranks, and `(rslice t d s)` is block `rank` of
`t`; all other constructors apply rank by rank. A rule that moves a term `z` into a family must
know that `z` has the same value on every rank: `(inv z)`. Windows state it for the reference's
relations (each equals the reference value on every rank), and the invariance rules below
propagate it through rank-wise constructors.
"""
from __future__ import annotations

import torch

from .base import Rule
from .examples import tensor
from .movement import MOVEMENT_OPS, SHAPE_DETERMINING
from .families import (ADDITIVE, BINARY_KEYS, COMPARISONS, LAST_DIM_KEYS, LINEAR_UNARY_KEYS,
                       NORMALIZATIONS, REDUCTIONS, SCALES_LEFT, SCALES_RIGHT, UNARY_KEYS,
                       share_keys)
from .terms import Family

RULESET = "ranks"
WORLD = 3  # ranks in every example
SHAPE = (3, 2, 5)  # one rank's part; examples shard dim 1


def family(gen: torch.Generator, *shape: int) -> Family:
    return Family(tensor(gen, *shape) for _ in range(WORLD))


def _part(dim: int = 1, shape: tuple[int, ...] = SHAPE, **extra):
    """`x` a family of parts concatenated along `dim` (bound as `c` when the op has its own `d`)."""
    def example(gen, choice):
        return {"x": family(gen, *shape), "c": dim, "s": shape[dim], **extra, **choice}
    return example


def _elementwise() -> list[Rule]:
    def broadcast(gen, choice):
        return {"x": family(gen, *SHAPE), "d": 1, "s": 2, "z": tensor(gen, 3, 1, 5), "n": 6,
                **choice}

    def two(gen, choice):
        return {"x": family(gen, *SHAPE), "y": family(gen, *SHAPE), "d": 1, "s": 2, **choice}

    def summed(gen, choice):
        return {"x": family(gen, *SHAPE), "y": tensor(gen, *SHAPE), **choice}

    def beside(gen, choice):  # the parts 2 (x) and 4 (y) wide
        return {"x": family(gen, 3, 2, 5), "y": tensor(gen, 3, 4, 5), "d": 1, "na": 2, "nb": 4,
                **choice}

    return [
        Rule("unary-over-rcat", "(unary f (rcat x d s))", "(rcat (unary f x) d s)",
             lambda gen, c: {"x": family(gen, *SHAPE), "d": 1, "s": 2, **c},
             families={"f": UNARY_KEYS}),
        Rule("binary-over-rcats", "(binary f (rcat x d s) (rcat y d s))",
             "(rcat (binary f x y) d s)", two, families={"f": BINARY_KEYS}),
        Rule("binary-over-rcat-and-broadcast", "(binary f (rcat x d s) (expand z d n))",
             "(rcat (binary f x (expand z d s)) d s)", broadcast, when=("(inv z)",),
             families={"f": BINARY_KEYS}),
        Rule("binary-over-broadcast-and-rcat", "(binary f (expand z d n) (rcat x d s))",
             "(rcat (binary f (expand z d s) x) d s)", broadcast, when=("(inv z)",),
             families={"f": BINARY_KEYS}),
        # Each rank's own block of elementwise results is the result on its blocks (a
        # partitioned optimizer step: each rank updates its block of the flat parameters).
        Rule("scaling-over-rslice", "(unary f (rslice x d s))", "(rslice (unary f x) d s)",
             lambda gen, c: {"x": family(gen, 3, 2 * WORLD, 5), "d": 1, "s": 2, **c},
             when=("(linear_unary f)",), families={"f": LINEAR_UNARY_KEYS}),
        Rule("binary-over-rslices", "(binary f (rslice x d s) (rslice y d s))",
             "(rslice (binary f x y) d s)",
             lambda gen, c: {"x": family(gen, 3, 2 * WORLD, 5), "y": family(gen, 3, 2 * WORLD, 5),
                             "d": 1, "s": 2, **c},
             when=("(= (dimsize x d) (dimsize y d))",), families={"f": BINARY_KEYS}),
        Rule("linear-unary-over-rsum", "(unary f (rsum x))", "(rsum (unary f x))",
             lambda gen, c: {"x": family(gen, *SHAPE), **c}, when=("(linear_unary f)",),
             families={"f": LINEAR_UNARY_KEYS}),
        Rule("zero-fill-over-rsum", '(masked_fill (rsum x) m "0.0")',
             '(rsum (masked_fill x m "0.0"))',
             lambda gen, c: {"x": family(gen, *SHAPE), "m": tensor(gen, *SHAPE) > 0},
             when=("(inv m)",)),
        Rule("additive-over-rsums", "(binary f (rsum x) (rsum y))", "(rsum (binary f x y))", two,
             when=("(additive f)",), families={"f": ADDITIVE}),
        # Sums over ranks side by side are the sum of the ranks' parts side by side (a flat
        # bucket all-reduced partition by partition, a gradient read across the cut).
        Rule("concat-of-rsums", "(concat (rsum x) (rsum y) d na nb)",
             "(rsum (concat x y d na nb))",
             lambda gen, c: {"x": family(gen, 3, 2, 5), "y": family(gen, 3, 4, 5), "d": 1,
                             "na": 2, "nb": 4}),
        Rule("scaling-over-rsum-left", "(binary f (rsum x) y)", "(rsum (binary f x y))", summed,
             when=("(scales_left f)", "(inv y)"), families={"f": SCALES_LEFT}),
        Rule("scaling-over-rsum-right", "(binary f y (rsum x))", "(rsum (binary f y x))", summed,
             when=("(scales_right f)", "(inv y)"), families={"f": SCALES_RIGHT}),
        # A replicated value added to (or taken from) a partial sum, a share on every rank
        # (DTensor turns a Replicate operand of an add with a Partial one into its value over
        # the world size).
        Rule("invariant-shared-over-rsum", "(binary f (rsum x) y)",
             "(rsum (binary f x (unary h y)))", summed,
             when=("(additive f)", "(inv y)", "(world_share h)"),
             families={"f": ADDITIVE, "h": tuple(sorted(share_keys(WORLD)))}),
        # A replicated value beside a sum over ranks: every rank's share of it beside its part
        # (DTensor's norm over partial norms stacked with a replicated one).
        Rule("invariant-beside-rsum", "(concat (rsum x) y d na nb)",
             "(rsum (concat x (unary h y) d na nb))", beside,
             when=("(inv y)", "(world_share h)"),
             families={"h": tuple(sorted(share_keys(WORLD)))}),
        Rule("rsum-beside-invariant", "(concat y (rsum x) d na nb)",
             "(rsum (concat (unary h y) x d na nb))",
             lambda gen, c: {**beside(gen, c), "na": 4, "nb": 2},
             when=("(inv y)", "(world_share h)"),
             families={"h": tuple(sorted(share_keys(WORLD)))}),
        # Every rank's share of a replicated value, summed over the ranks (DTensor's share of a
        # replicated norm in a norm over partial ones), is the value.
        Rule("invariant-shares-summed", "(rsum (unary h y))", "y", summed,
             when=("(inv y)", "(world_share h)"),
             families={"h": tuple(sorted(share_keys(WORLD)))}),
    ]


def _row_wise() -> list[Rule]:
    """Ops that act on each position alone commute with a rank concatenation of all their
    operands (a batch or sequence split), or of one operand beside invariant broadcasts."""
    def ints(gen, *shape):
        return Family(torch.randint(-2, 3, shape, generator=gen) for _ in range(WORLD))

    def compare(gen, choice):
        return {"x": ints(gen, *SHAPE), "d": 1, "s": 2, "v": 1, **choice}

    def masked(gen, choice):
        return {"x": family(gen, *SHAPE), "m": Family(t > 0 for t in ints(gen, *SHAPE)), "d": 1,
                "s": 2, "v": "0.0"}

    def selected(gen, choice):
        return {"c": Family(t > 0 for t in ints(gen, *SHAPE)), "x": family(gen, *SHAPE),
                "y": family(gen, *SHAPE), "d": 1, "s": 2, "n": 2 * WORLD,
                "u": tensor(gen, 3, 1, 5), "w": tensor(gen, 3, 1, 5)}

    def rows(gen, choice):
        return {"x": family(gen, 2, 3, 5), "g": family(gen, 2, 3),
                "t": Family(torch.randint(0, 5, (2, 3), generator=gen) for _ in range(WORLD)),
                "d": 0, "s": 2, "v": 5, "k": 2}

    def targets(gen, choice):
        return {"t": torch.randint(-3, 9, (3, 5), generator=gen), "d": 1, "a": 4, "b": -2,
                **choice}

    return [
        Rule("compare-over-rcat", "(cmp_int f (rcat x d s) v)", "(rcat (cmp_int f x v) d s)",
             compare, families={"f": COMPARISONS}),
        Rule("add-int-over-rcat", "(add_int (rcat x d s) v)", "(rcat (add_int x v) d s)", compare),
        Rule("rank-compare-over-unsqueeze", "(cmp_int_r f (unsqueeze t d) a b)",
             "(unsqueeze (cmp_int_r f t a b) d)", targets, families={"f": COMPARISONS}),
        # Range tests on ids shifted by each rank's start: tests on the ids themselves.
        Rule("rank-compare-of-rank-shifted", "(cmp_int f (add_int_r t a b) v)",
             "(cmp_int_r f t (- 0 a) (- v b))",
             lambda gen, c: {**targets(gen, c), "v": 3}, families={"f": COMPARISONS}),
        Rule("rank-compare-of-shifted", "(cmp_int_r f (add_int t o) a b)",
             "(cmp_int_r f t a (- b o))",
             lambda gen, c: {**targets(gen, c), "o": -3}, families={"f": COMPARISONS}),
        Rule("rank-add-int-over-unsqueeze", "(add_int_r (unsqueeze t d) a b)",
             "(unsqueeze (add_int_r t a b) d)", targets),
        Rule("masked-fill-over-rcats", "(masked_fill (rcat x d s) (rcat m d s) v)",
             "(rcat (masked_fill x m v) d s)", masked),
        Rule("masked-fill-over-broadcast-and-rcat", "(masked_fill (expand u d n) (rcat m d s) v)",
             "(rcat (masked_fill (expand u d s) m v) d s)",
             lambda gen, c: {**masked(gen, c), "u": tensor(gen, 3, 1, 5), "n": 2 * WORLD},
             when=("(inv u)",)),
        Rule("masked-fill-over-rcat-and-broadcast", "(masked_fill (rcat x d s) (expand u d n) v)",
             "(rcat (masked_fill x (expand u d s) v) d s)",
             lambda gen, c: {**masked(gen, c), "u": torch.randint(-2, 3, (3, 1, 5), generator=gen) > 0,
                             "n": 2 * WORLD},
             when=("(inv u)",)),
        Rule("last-dim-op-over-rcat", "(opaque1 f (rcat x d s))", "(rcat (opaque1 f x) d s)",
             lambda gen, c: {"x": family(gen, *SHAPE), "d": 1, "s": SHAPE[1], **c},
             when=("(last_dim f)", "(< (+ d 1) (ndim x))"), families={"f": LAST_DIM_KEYS}),
        Rule("where-over-rcats", "(where3 (rcat c d s) (rcat x d s) (rcat y d s))",
             "(rcat (where3 c x y) d s)", selected),
        Rule("where-over-rcat-and-broadcasts", "(where3 (rcat c d s) (expand u d n) (expand w d n))",
             "(rcat (where3 c (expand u d s) (expand w d s)) d s)", selected,
             when=("(inv u)", "(inv w)")),
        Rule("where-over-rcat-broadcast-rcat", "(where3 (rcat c d s) (expand u d n) (rcat y d s))",
             "(rcat (where3 c (expand u d s) y) d s)", selected, when=("(inv u)",)),
        Rule("where-over-rcat-rcat-broadcast", "(where3 (rcat c d s) (rcat x d s) (expand w d n))",
             "(rcat (where3 c x (expand w d s)) d s)", selected, when=("(inv w)",)),
        Rule("where-over-broadcast-rcat-broadcast", "(where3 (expand u d n) (rcat x d s) (expand w d n))",
             "(rcat (where3 (expand u d s) x (expand w d s)) d s)",
             lambda gen, c: {**selected(gen, c), "u": torch.randint(-2, 3, (3, 1, 5), generator=gen) > 0},
             when=("(inv u)", "(inv w)")),
        Rule("embedding-grad-over-rcat-tokens", "(embedding_grad (rcat g d s) (rcat t d s) v)",
             "(rsum (embedding_grad g t v))",
             lambda gen, c: {"g": family(gen, 2, 3, 4), "d": 0, "s": 2, "v": 5,
                             "t": Family(torch.randint(0, 5, (2, 3), generator=gen)
                                         for _ in range(WORLD))}),
        Rule("take-over-rcats", "(take (rcat x d s) (rcat t d s) k)", "(rcat (take x t k) d s)",
             rows, when=("(< d k)",)),
        Rule("untake-over-rcats", "(untake (rcat g d s) (rcat t d s) v k)",
             "(rcat (untake g t v k) d s)", rows, when=("(< d k)",)),
        Rule("untake-over-broadcast-and-rcat", "(untake (expand z d n) (rcat t d s) v k)",
             "(rcat (untake (expand z d s) t v k) d s)",
             lambda gen, c: {**rows(gen, c), "z": tensor(gen, 1, 3), "n": 2 * WORLD},
             when=("(inv z)", "(< d k)")),
    ]


def _reductions() -> list[Rule]:
    other = lambda gen, c: {"x": family(gen, *SHAPE), "d": 1, "s": 2, "k": 2, **c}  # noqa: E731
    same = lambda gen, c: {"x": family(gen, *SHAPE), "d": 1, "s": 2}  # noqa: E731
    return [
        Rule("reduce-over-rcat-other-dim", "(reduce f (rcat x d s) k)", "(rcat (reduce f x k) d s)",
             other, when=("(!= d k)",), families={"f": REDUCTIONS}),
        Rule("normalize-over-rcat-other-dim", "(softmax f (rcat x d s) k)",
             "(rcat (softmax f x k) d s)", other, when=("(!= d k)",),
             families={"f": NORMALIZATIONS}),
        Rule("sum-over-rcat-dim", '(reduce "sum" (rcat x d s) d)', '(rsum (reduce "sum" x d))', same),
        Rule("amax-over-rcat-dim", '(reduce "amax" (rcat x d s) d)', '(rmax (reduce "amax" x d))',
             same),
        # A sum of per-block contractions, each over ranks, is one contraction over ranks of
        # the block sums (fused [q|k|v] gradients).
        Rule("psum-of-rsums", "(psum (rsum x) (rsum y))", "(rsum (psum x y))",
             lambda gen, c: {"x": family(gen, *SHAPE), "y": family(gen, *SHAPE)}),
        Rule("sum-over-rsum", '(reduce "sum" (rsum x) k)', '(rsum (reduce "sum" x k))',
             lambda gen, c: {"x": family(gen, *SHAPE), "k": 1}),
    ]


def _matmuls() -> list[Rule]:
    b, m, k, n = 2, 3, 4, 5

    def example(x_shape, y_shape, x_family, y_family, **extra):
        def make(gen, choice):
            x = family(gen, *x_shape) if x_family else tensor(gen, *x_shape)
            y = family(gen, *y_shape) if y_family else tensor(gen, *y_shape)
            return {"x": x, "y": y, "r": 3, **extra}
        return make

    return [
        Rule("matmul-batch-rcats", "(matmul (rcat x d s) (rcat y d s) r)",
             "(rcat (matmul x y r) d s)", example((b, m, k), (b, k, n), True, True, d=0, s=b),
             when=("(< d (- r 2))",)),
        Rule("matmul-batch-rcat-broadcast", "(matmul (rcat x d s) (expand y d e) r)",
             "(rcat (matmul x (expand y d s) r) d s)",
             example((b, m, k), (1, k, n), True, False, d=0, s=b, e=b * WORLD),
             when=("(< d (- r 2))", "(inv y)")),
        Rule("matmul-broadcast-batch-rcat", "(matmul (expand y d e) (rcat x d s) r)",
             "(rcat (matmul (expand y d s) x r) d s)",
             example((b, k, n), (1, m, k), True, False, d=0, s=b, e=b * WORLD),
             when=("(< d (- r 2))", "(inv y)")),
        Rule("matmul-rcat-rows", "(matmul (rcat x d s) y r)", "(rcat (matmul x y r) d s)",
             example((b, m, k), (b, k, n), True, False, d=1, s=m), when=("(= d (- r 2))", "(inv y)")),
        Rule("matmul-rcat-columns", "(matmul y (rcat x d s) r)", "(rcat (matmul y x r) d s)",
             example((b, k, n), (b, m, k), True, False, d=2, s=n), when=("(= d (- r 1))", "(inv y)")),
        Rule("matmul-rcat-contraction", "(matmul (rcat x d s) (rcat y e s) r)",
             "(rsum (matmul x y r))", example((b, m, k), (b, k, n), True, True, d=2, e=1, s=k),
             when=("(= d (- r 1))", "(= e (- r 2))")),
        Rule("matmul-rsum-left", "(matmul (rsum x) y r)", "(rsum (matmul x y r))",
             example((b, m, k), (b, k, n), True, False), when=("(inv y)",)),
        Rule("matmul-rsum-right", "(matmul y (rsum x) r)", "(rsum (matmul y x r))",
             example((b, k, n), (b, m, k), True, False), when=("(inv y)",)),
    ]


def _moved(name: str, op: str, attrs: str, new_dim: str, when: tuple[str, ...], example,
           size: str = "s") -> Rule:
    return Rule(name, f"({op} (rcat x c s) {attrs})", f"(rcat ({op} x {attrs}) {new_dim} {size})",
                example, when=when)


def _movement() -> list[Rule]:
    four = (4, 6, 2, 3)
    unit = (4, 6, 1, 3)

    def summed(op: str, attrs: str, shape: tuple[int, ...], combine: str, **extra) -> Rule:
        return Rule(f"{op}-over-{combine}", f"({op} ({combine} x) {attrs})",
                    f"({combine} ({op} x {attrs}))",
                    lambda gen, c: {"x": family(gen, *shape), **extra})

    def interchange(gen, choice):
        return {"x": family(gen, 2, 2), "y": family(gen, 2, 4), "d": 0, "s": 2, "k": 1, "ma": 2,
                "mb": 4}

    def gathered_block(gen, choice):
        return {"t": tensor(gen, 2, 3 * WORLD), "d": 1, "s": 3}

    return [
        _moved("merge-rcat-before", "merge", "d i", "c", ("(< c d)",), _part(0, four, d=1, i=2)),
        _moved("merge-rcat-outer", "merge", "d i", "c", ("(= c d)",), _part(1, four, d=1, i=2),
               size="(* s i)"),
        _moved("merge-rcat-after", "merge", "d i", "(- c 1)", ("(> c (+ d 1))",),
               _part(3, four, d=1, i=2)),
        # The converse, for rows merged before they are joined (a loss's [b * s, v] logits
        # against ranks that pick from [b, s, v] ones).
        Rule("rcat-of-merged-rows", "(rcat (merge x d i) k s)", "(merge (rcat x (+ k 1) s) d i)",
             lambda gen, c: {"x": family(gen, *four), "d": 0, "i": 6, "k": 1, "s": 2},
             when=("(> k d)",)),
        _moved("split-rcat-before", "split", "d i", "c", ("(< c d)",), _part(0, four, d=1, i=3)),
        _moved("split-rcat-same", "split", "d i", "c", ("(= c d)", "(= (% s i) 0)"),
               _part(1, four, d=1, i=2), size="(/ s i)"),
        _moved("split-rcat-after", "split", "d i", "(+ c 1)", ("(> c d)",), _part(1, four, d=0, i=2)),
        _moved("unsqueeze-rcat-before", "unsqueeze", "d", "c", ("(< c d)",), _part(1, four, d=2)),
        _moved("unsqueeze-rcat-after", "unsqueeze", "d", "(+ c 1)", ("(>= c d)",),
               _part(1, four, d=1)),
        _moved("squeeze-rcat-before", "squeeze", "d", "c", ("(< c d)",), _part(1, unit, d=2)),
        _moved("squeeze-rcat-after", "squeeze", "d", "(- c 1)", ("(> c d)",),
               _part(3, (4, 1, 2, 3), d=1)),
        _moved("transpose-rcat-first", "transpose", "d e", "e", ("(= c d)",), _part(1, four, d=1, e=3)),
        _moved("transpose-rcat-second", "transpose", "d e", "d", ("(= c e)",),
               _part(3, four, d=1, e=3)),
        _moved("transpose-rcat-other", "transpose", "d e", "c", ("(!= c d)", "(!= c e)"),
               _part(0, four, d=1, e=3)),
        _moved("expand-rcat", "expand", "d n", "c", ("(!= c d)",), _part(1, unit, d=2, n=5)),
        _moved("slice-rcat-other", "slice", "d a b", "c", ("(!= c d)",), _part(1, four, d=3, a=1, b=3)),
        _moved("pad-rcat-other", "pad", "d a b v", "c", ("(!= c d)",),
               _part(1, four, d=3, a=1, b=2, v="0.0")),
        Rule("concat-rcat-interchange", "(concat (rcat x d s) (rcat y d s) k ma mb)",
             "(rcat (concat x y k ma mb) d s)", interchange, when=("(!= d k)",)),
        Rule("rcat-of-own-blocks", "(rcat (rslice t d s) d s)", "t", gathered_block,
             when=("(inv t)",)),
        Rule("own-block-of-rcat", "(rslice (rcat x d s) d s)", "x", _part(1, d=1)),
        # Any rank's block of a gathered tensor that every rank holds alike is that tensor
        # (a broadcast from a root: the root's block of an all_gather).
        Rule("block-of-invariant-rcat", "(slice (rcat x d s) d a b)", "x",
             lambda gen, c: {"x": tensor(gen, *SHAPE), "d": 1, "s": SHAPE[1], "a": SHAPE[1],
                             "b": 2 * SHAPE[1]},
             when=("(inv x)", "(= b (+ a s))", "(= 0 (% a s))")),
        # Name the parts of a rank's concat as slices of it (its fused blocks, e.g. [q|k|v]).
        Rule("concat-parts-are-slices", "(concat a b d na nb)",
             "(concat (slice (concat a b d na nb) d 0 na) "
             "(slice (concat a b d na nb) d na (+ na nb)) d na nb)",
             lambda gen, c: {"a": tensor(gen, 2, 3), "b": tensor(gen, 2, 4), "d": 1, "na": 3,
                             "nb": 4}),
        # A rank's own block of a replicated tensor names the blocks that tile it (backward of a
        # gather): the rewrite adds the tiling, which the rule above equates with `t`.
        Rule("own-block-tiles", "(rslice t d s)", "(rslice (rcat (rslice t d s) d s) d s)",
             gathered_block, when=("(inv t)",)),
        # Each rank's block put at its place in zeros (the backward of taking the own block):
        # summed over the ranks, the blocks side by side.
        Rule("rank-blocks-in-zeros", "(rcat x d s)", "(rsum (rpad x d s))",
             lambda gen, c: {"x": family(gen, 2, 3), "d": 1, "s": 3}, trigger="(rpad x d s)"),
        *(summed(op, attrs, shape, combine, **example) for op, attrs, shape, example
          in MOVEMENT_OPS for combine in ("rsum", "rmax")),
        *(Rule(f"{combine}-of-{op}", f"({combine} ({op} x {attrs}))", f"({op} ({combine} x) {attrs})",
               lambda gen, c, shape=shape, example=example: {"x": family(gen, *shape), **example})
          for op, attrs, shape, example in MOVEMENT_OPS if op in SHAPE_DETERMINING
          for combine in ("rsum", "rmax")),
    ]


def _embedding() -> list[Rule]:
    def table(gen, choice):
        rows = 4
        return {"w": family(gen, rows, 3), "s": rows,
                "ids": torch.randint(0, rows * WORLD, (2, 5), generator=gen)}

    def masked(gen, choice):
        env = table(gen, choice)
        return {**env, "a": -env["s"], "b": 0, "k": 2, "h": 3,
                "m": _rank_mask(env["ids"], env["s"])}

    def gradient(gen, choice):
        rows = 4
        ids = torch.randint(0, rows * WORLD, (2, 5), generator=gen)
        return {"g": tensor(gen, 2, 5, 3), "ids": ids, "s": rows, "w": WORLD, "a": -rows, "b": 0,
                "k": 2, "h": 3, "m": _rank_mask(ids, rows)}

    def columns(gen, choice):
        rows, cols = 4, 3
        return {"w": family(gen, rows, cols), "g": family(gen, 2, 5, cols), "s": cols, "k": 2,
                "n": rows, "ids": torch.randint(0, rows, (2, 5), generator=gen)}

    lookup = ('(masked_fill (embedding w (masked_fill (add_int_r ids a b) m "0")) '
              '(expand (unsqueeze m k) k h) "0.0")')
    grad_lookup = ('(embedding_grad (masked_fill g (expand (unsqueeze m k) k h) "0.0") '
                   '(masked_fill (add_int_r ids a b) m "0") s)')
    rank_range = "(embed_grad_rrange g ids s)"
    shifted = "(add_int_r ids a b)"
    clamped_shifted = (f'(masked_fill (masked_fill {shifted} (cmp_int "lt" {shifted} l) u) '
                       f'(cmp_int "gt" {shifted} c) v)')
    clamped = (f'(masked_fill (embedding w {clamped_shifted}) '
               '(expand (unsqueeze m k) k h) "0.0")')
    clamped_grad = (f'(embedding_grad (masked_fill g (expand (unsqueeze m k) k h) "0.0") '
                    f'{clamped_shifted} s)')

    def clamped_ids(gen, choice):
        return {**masked(gen, choice), "l": 0, "c": 3, "u": "0", "v": "3"}

    def classes(gen, choice):
        rows = 4
        index = torch.randint(0, rows * WORLD, (2, 5), generator=gen)
        return {"x": family(gen, 2, 5, rows), "t": index, "s": rows, "k": 2, "a": -rows, "b": 0,
                "m": _rank_mask(index, rows)}

    picked = '(masked_fill (take x (masked_fill (add_int_r t a b) m "0") k) m "0.0")'
    picked_grad = '(untake (masked_fill g m "0.0") (masked_fill (add_int_r t a b) m "0") s k)'
    own_classes = "(untake_rrange g t s k)"

    def classes_grad(gen, choice):
        rows = 4
        index = torch.randint(0, rows * WORLD, (2, 5), generator=gen)
        return {"g": tensor(gen, 2, 5), "t": index, "s": rows, "k": 2, "a": -rows, "b": 0,
                "w": WORLD, "m": _rank_mask(index, rows)}

    return [
        # A vocab-parallel loss: each rank picks the target's logit among the classes it holds
        # (zero elsewhere); summed over ranks that is the pick from the whole class dim.
        Rule("take-over-rcat-classes", "(take (rcat x k s) t k)", "(rsum (take_rrange x t s k))",
             classes, when=("(inv t)",)),
        Rule("rank-take-of-transposed-rows", "(take_rrange (transpose x d e) t s k)",
             "(transpose (take_rrange x (transpose t d e) s k) d e)",
             lambda gen, c: {"x": family(gen, 2, 5, 4), "s": 4, "k": 2, "d": 0, "e": 1,
                             "t": torch.randint(0, 4 * WORLD, (5, 2), generator=gen)}),
        Rule("masked-rank-take", picked, "(take_rrange x t s k)", classes,
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" t s 0) (cmp_int_r "ge" t s s)))',
                   "(= a (- 0 s))", "(= b 0)", "(= s (dimsize x k))")),
        # Its gradient: each rank puts the tokens' gradients at the targets among its own
        # classes (the backward of the masked pick); together they tile the whole class dim.
        Rule("masked-rank-untake", picked_grad, own_classes, classes_grad,
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" t s 0) (cmp_int_r "ge" t s s)))',
                   "(= a (- 0 s))", "(= b 0)")),
        Rule("rank-classes-tile", own_classes, f"(rslice (rcat {own_classes} k s) k s)",
             classes_grad),
        Rule("untake-over-rank-classes", f"(rcat {own_classes} k s)", "(untake g t (* s w) k)",
             classes_grad, when=("(inv g)", "(inv t)", "(= w (world))")),
        Rule("embedding-over-rcat-ids", "(embedding w (rcat ids d s))",
             "(rcat (embedding w ids) d s)",
             lambda gen, c: {"w": tensor(gen, 5, 3), "d": 0, "s": 2,
                             "ids": Family(torch.randint(0, 5, (2, 4), generator=gen)
                                           for _ in range(WORLD))},
             when=("(inv w)",)),
        # A table sharded by columns (fairscale's ParallelEmbedding): each rank looks up its
        # own columns, which join along the lookup's last dim (one past the ids' dims).
        Rule("embedding-over-rcat-columns", "(embedding (rcat w 1 s) ids)",
             "(rcat (embedding w ids) k s)", columns, when=("(inv ids)", "(= k (ndim ids))")),
        Rule("embedding-grad-over-rcat-columns", "(embedding_grad (rcat g k s) ids n)",
             "(rcat (embedding_grad g ids n) 1 s)", columns,
             when=("(inv ids)", "(= k (ndim ids))")),
        Rule("embedding-over-rcat-rows", "(embedding (rcat w 0 s) ids)",
             "(rsum (embed_rrange w ids s))", table, when=("(inv ids)",)),
        Rule("rank-lookup-of-transposed-ids", "(embed_rrange w (transpose ids d e) s)",
             "(transpose (embed_rrange w ids s) d e)",
             lambda gen, c: {**table(gen, c), "d": 0, "e": 1}),
        Rule("masked-rank-lookup", lookup, "(embed_rrange w ids s)", masked,
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" ids s 0) (cmp_int_r "ge" ids s s)))',
                   "(= a (- 0 s))", "(= b 0)", "(= s (dimsize w 0))")),
        # A rank's ids out of its rows are those not in them (torchtitan tests `ge & lt`).
        Rule("rank-out-of-range-is-not-in-range",
             '(unary "bitwise_not" (binary "bitwise_and" (cmp_int_r "ge" ids s b) '
             '(cmp_int_r "lt" ids s c)))',
             '(binary "bitwise_or" (cmp_int_r "lt" ids s b) (cmp_int_r "ge" ids s c))',
             lambda gen, choice: {**table(gen, choice), "b": 0, "c": 4}),
        # torchtitan clamps the shifted ids into the rank's rows: where that changes an id,
        # the mask zeroes its row, so the clamped lookup is the masked one.
        Rule("clamped-rank-lookup", clamped, lookup, clamped_ids,
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" ids s 0) (cmp_int_r "ge" ids s s)))',
                   "(= a (- 0 s))", "(= b 0)", "(<= l 0)", "(>= c (- s 1))")),
        # Its gradient: the rows the mask zeroes go to whichever row the clamp chose.
        Rule("clamped-rank-grad-lookup", clamped_grad, grad_lookup,
             lambda gen, choice: {**gradient(gen, choice), "l": 0, "c": 3, "u": "0", "v": "3"},
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" ids s 0) (cmp_int_r "ge" ids s s)))',
                   "(= a (- 0 s))", "(= b 0)", "(<= l 0)", "(>= c (- s 1))")),
        # The table gradient of a vocab-parallel embedding: each rank scatters the tokens of its
        # own rows (the backward of the masked lookup); together they tile the whole gradient.
        Rule("masked-rank-grad-lookup", grad_lookup, rank_range, gradient,
             when=('(= m (binary "bitwise_or" (cmp_int_r "lt" ids s 0) (cmp_int_r "ge" ids s s)))',
                   "(= a (- 0 s))", "(= b 0)")),
        Rule("rank-grad-rows-tile", rank_range, f"(rslice (rcat {rank_range} 0 s) 0 s)", gradient),
        Rule("embedding-grad-over-rank-rows", f"(rcat {rank_range} 0 s)",
             "(embedding_grad g ids (* s w))", gradient,
             when=("(inv g)", "(inv ids)", "(= w (world))")),
    ]


def _rank_mask(ids: torch.Tensor, rows: int) -> Family:
    return Family((ids < r * rows) | (ids >= (r + 1) * rows) for r in range(WORLD))


def rules() -> list[Rule]:
    return [*_elementwise(), *_row_wise(), *_reductions(), *_matmuls(), *_movement(), *_embedding()]


# Invariance: the whole-family constructors give one value on every rank, and rank-wise
# constructors keep it (constructors with rank-dependent constants are left out on purpose).
_RANK_WISE = {
    "unary": "f x", "binary": "f x y", "where3": "x y z", "reduce": "f x d", "softmax": "f x d",
    "matmul": "x y d", "merge": "x d i", "split": "x d i", "unsqueeze": "x d", "squeeze": "x d",
    "transpose": "x d e", "expand": "x d n", "slice": "x d a b", "concat": "x y d a b",
    "embedding": "x y", "embedding_grad": "x y d", "take": "x y d", "untake": "x y d e", "masked_fill": "x y f", "pad": "x d a b f", "cmp_int": "f x d", "add_int": "x d",
}
_TENSOR_ARGS = ("x", "y", "z")
# Data movement that loses no element (and negation): an invariant result has invariant operands.
_INJECTIVE = {head: _RANK_WISE[head] for head in
              ("merge", "split", "unsqueeze", "squeeze", "transpose", "expand", "concat")}


def fact_rules() -> list[str]:
    """Invariance (up through rank-wise constructors, down through lossless movement) and
    part-size facts."""
    whole = [f"(rule ((= t ({head}))) ((inv t)) :ruleset {RULESET})"
             for head in ("rcat x d s", "rsum x", "rmax x", "const f")]
    sizes = [f"(rule ((= t (rcat x d s))) ((set (dimsize x d) s)) :ruleset {RULESET})"]
    injective = [f"(rule ((= t ({head} {args})) (inv t)) ({' '.join(f'(inv {a})' for a in args.split() if a in _TENSOR_ARGS)}) :ruleset {RULESET})"
                 for head, args in _INJECTIVE.items()]
    injective.append(f'(rule ((= t (unary "neg" x)) (inv t)) ((inv x)) :ruleset {RULESET})')
    wise = []
    for head, args in _RANK_WISE.items():
        tensors = [a for a in args.split() if a in _TENSOR_ARGS]
        premises = " ".join(f"(inv {a})" for a in tensors)
        wise.append(f"(rule ((= t ({head} {args})) {premises}) ((inv t)) :ruleset {RULESET})")
    return whole + sizes + wise + injective
