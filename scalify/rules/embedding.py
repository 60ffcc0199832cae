"""Embedding lookups over a vocab-sharded table, and the masked-lookup idiom of vocab parallelism.

`embed_range(w, ids, s)` is the lookup of `ids` in rows [s, s + rows(w)) of a larger table,
zero outside that range. Reference ids are assumed to lie in [0, vocab).
"""
from __future__ import annotations

import torch

from .base import Rule
from .examples import tensor

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



def _masked(gen, choice):
    w, ids, s = tensor(gen, 4, 3), torch.randint(0, 10, (2, 5), generator=gen), 2
    mask = (ids < s) | (ids >= s + 4)
    return {"w": w, "ids": ids, "s": s, "e": s + 4, "o": -s, "m": mask, "k": 2, "h": 3}


def rules() -> list[Rule]:
    return [
        Rule("embedding-as-range", "(embedding w ids)", "(embed_range w ids 0)",
             lambda gen, c: {"w": tensor(gen, 5, 4), "ids": torch.randint(0, 5, (2, 6), generator=gen)}),
        Rule("embed-range-over-rows", "(embed_range (concat a b 0 na nb) ids s)",
             "(psum (embed_range a ids s) (embed_range b ids (+ s na)))", _table_shifted),
        Rule("masked-lookup", MASKED_LOOKUP, "(embed_range w ids s)", _masked,
             when=('(= m (binary "bitwise_or" (cmp_int "lt" ids s) (cmp_int "ge" ids e)))',
                   "(= o (- 0 s))", "(= e (+ s (dimsize w 0)))")),
    ]
