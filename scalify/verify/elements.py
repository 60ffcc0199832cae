"""Relations found by numbering elements by how they were computed.

A reference op whose inputs relate to rank tensors through data movement (heads regrouped by an
all-to-all, a batch merged with heads, kv heads repeated or held by several ranks) often has
ranks that compute the same elements laid out another way, where rewriting one layout into the
other takes an e-graph many steps. Here every element gets an integer id that names how it was
computed (value numbering): a rank tensor no rule below reads gets fresh ids, data movement moves
ids, and an op's output element gets one id per op, attributes and the ids it reads (its
operands' elements for an elementwise op, the row for a softmax or a reduction, the row and
column for a matmul, or its products: `Products`). Equal ids are equal values. The reference op
applied to its inputs' relations is numbered the same way; when every id it yields is held by
some rank tensor, the reference value is those tensors' elements laid out as found (layout.py),
an exact relation.
Replicas the relations name (`Relation.aliases`) count as the tensor they copy, and rank inputs
laid out in pieces (`Custom` placements) hold the ids of the reference elements each piece
holds, so pieces several ranks hold (kv heads replicated across tensor-parallel ranks beside
sharded query heads) number alike. Gathers and replacing scatters whose indices are constants
(a paged cache written at its slots and read through its block table) move ids as they move
values. Deterministic ops only (a random draw is a fresh tensor).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Callable, Literal

import torch

from ..ir.graph import Node
from ..ir.ops import OPS
from ..rules.terms import App, Term, evaluate, leaves, parse, parse_op_key, render
from .layout import layout_term
from .places import affine_places
from .polynomials import OverBudget, Polynomials
from .relations import Relation, concat_terms, leaf

Shape = tuple[int, ...]
# How a matmul element is numbered: the polynomial sum of its products (a small program), one
# id per row and column (a large one: cheap), or the sum of its products left unexpanded (a
# large one whose split contraction, summed over ranks, must get the whole one's id: only the
# contractions the value sums or moves, its operands and all else numbered as by `opaque`).
Products = Literal["expanded", "opaque", "unexpanded"]
MOVES = frozenset({"concat", "slice", "expand", "unsqueeze", "squeeze", "merge", "split",
                   "transpose"})
ELEMENTWISE = frozenset({"unary", "binary", "where3", "masked_fill", "psum", "pmax", "cmp_int",
                         "add_int"})
# Reductions numbered by the algebra (a sum as a polynomial, a max as the set it is taken of), so
# a reduction the ranks split and combine gets the whole one's ids: function -> Polynomials method.
_ALGEBRAIC_REDUCTIONS = {"sum": "sum_of", "amax": "maximum"}
# Ops through which an "unexpanded" numbering still reaches contractions it leaves unexpanded.
SUMMED_OR_MOVED = MOVES | {"psum", "reduce", "matmul", "dist"}
# Ops that place copies of elements where constant indices say (a gather, a scatter that
# replaces): the positions of their index operands.
PLACED_BY_INDEX = {"index": lambda n, attrs: range(1, n),
                   "index_put": lambda n, attrs: () if attrs.get("accumulate") else range(1, n - 1),
                   "take": lambda n, attrs: (1,), "embedding": lambda n, attrs: (1,)}
_CONST_KEYS = re.compile(r'\(const "([0-9a-f]+)"\)')
ELEMENT_LIMIT = 1 << 20  # elements numbered per tensor; larger ones are left to the e-graph
BUDGET = 1 << 21  # elements numbered per query; past it rank tensors get fresh ids
WORK_LIMIT = 1 << 20  # polynomial terms built per query; past it the query is not numbered
DOT_LIMIT = 256  # monomials a matmul element may expand to; past it, products stay unexpanded
CONSTANT_VALUES = 4096  # distinct values a constant may have to be numbered by its values
DEPTH = 150  # definitions followed upstream from one query
RESUMED_QUERIES = 4  # budgets a followed value may take, each resuming from the last


@dataclass(frozen=True)
class HeldPiece:
    """Indices [local_start, local_start + size) along `dim` of a rank input hold indices
    [ref_start, ref_start + size) of reference input `target` (of `ref_shape`)."""

    target: str
    ref_shape: Shape
    dim: int
    local_start: int
    ref_start: int
    size: int


class Origins:
    """Element ids of terms over rank tensors and constants (see the module docstring)."""

    def __init__(self, definition: Callable[[str], Term | None], shape_of: Callable[[str], Shape],
                 const_shape: Callable[[str], Shape | None], replicas: dict[str, str],
                 pieces: dict[str, list[HeldPiece]] | None = None,
                 const_value: Callable[[str], torch.Tensor | None] = lambda key: None,
                 polynomials: Polynomials | None = None, products: Products = "expanded",
                 below: Origins | None = None) -> None:
        """`below`: for "unexpanded" products, the "opaque" numbering (whose polynomials it
        shares) that numbers what the value's own sums and moves do not reach."""
        self._definition, self._shape_of, self._const_shape = definition, shape_of, const_shape
        self._const_value = const_value
        self._replicas = replicas  # a replica's name -> the name of the tensor it copies
        self._pieces = pieces or {}  # a rank input's name -> the reference pieces it holds
        self._ids: dict[str, torch.Tensor | None] = {}
        # (shared, so its ids are exact everywhere)
        self._poly = below._poly if below is not None else polynomials or Polynomials()
        self.products = products
        self.below = below
        self._row_ids: dict[int, tuple[int, ...]] = {}  # a row's id -> its elements' ids
        self._computed: dict[App, torch.Tensor] = {}  # an op's term -> its ids
        self._spent = 0
        self._depth = 0
        self._over_budget = False  # this query's work ran past its limit somewhere
        self.held = 0  # elements whose ids are kept (its memory)

    def new_query(self) -> Origins:
        """Restart the per-query budgets (ids numbered so far are kept: they stay exact)."""
        self._spent = 0
        self._over_budget = False
        self._poly.work = 0
        self._poly.limit = WORK_LIMIT
        if self.below is not None:
            self.below.new_query()
        return self

    @property
    def over_budget(self) -> bool:
        """Whether this query's work ran past its limit somewhere."""
        return self._over_budget or self.below is not None and self.below.over_budget

    def of_resumed(self, term: Term, queries: int = RESUMED_QUERIES) -> torch.Tensor | None:
        """`of(term)`, numbered over up to `queries` queries' budgets while one runs out: each
        resumes from the ops the last one numbered (a value deep in a large program)."""
        ids = self.of(term)
        for _ in range(queries - 1):
            if ids is not None or not self.over_budget:
                break
            ids = self.new_query().of(term)
        return ids

    def of(self, term: Term) -> torch.Tensor | None:
        """The ids of `term`'s elements, or None (an op numbered by no rule, or too large)."""
        if not isinstance(term, App):
            return None
        if self.below is not None and (term.head not in SUMMED_OR_MOVED or term.head == "reduce"
                                        and term.args[0] != "sum"):
            return self.below.of(term)
        if term.head == "dist":
            return self._of_name(self._replicas.get(term.args[0], term.args[0]))
        if term.head == "const":
            key = render(term)
            if key not in self._ids:
                self._ids[key] = self._constant(key)
            return self._ids[key]
        ids = self._computed.get(term)
        if ids is None:
            ids = self._computed_ids(term)
            if ids is not None and not self.over_budget:  # (past a budget its operands may
                self._computed[term] = ids                 # be fresh: a later query numbers it)
                self.held += ids.numel()
        return ids

    def _computed_ids(self, term: App) -> torch.Tensor | None:
        placed = self._placed_by_index(term)
        if placed is not None:
            return placed
        number = self.below.of if self.below is not None and term.head == "matmul" else self.of
        operands = [number(a) if isinstance(a, App) else a for a in term.args]
        if any(o is None for o in operands):
            return None
        tensors = [o for o in operands if isinstance(o, torch.Tensor)]
        if any(t.numel() > ELEMENT_LIMIT for t in tensors):
            return None
        try:
            ids = self._apply(term.head, operands, tensors)
        except (ValueError, RuntimeError):  # ill-shaped: no numbering, not an error
            return None
        except OverBudget:
            self._over_budget = True
            return None
        if ids is not None:
            self._spent += ids.numel()
        return ids

    def _apply(self, head: str, operands: list, tensors: list[torch.Tensor]
               ) -> torch.Tensor | None:
        attrs = tuple(o for o in operands if not isinstance(o, torch.Tensor))
        if head in MOVES:
            env = {f"a{i}": t for i, t in enumerate(tensors)}
            names = iter(env)
            args = [f"?{next(names)}" if isinstance(o, torch.Tensor) else o for o in operands]
            return evaluate(App(head, tuple(args)), env)
        if head in ELEMENTWISE:
            if len({t.shape for t in tensors}) != 1:
                return None
            return self._per_element(lambda row: self._elementwise(head, attrs, row), tensors)
        if head == "matmul":
            return self._matmul(*tensors)
        if head in ("softmax", "reduce"):
            function, x, dim = operands
            rows = self._rows(x.movedim(dim, -1))
            if head == "reduce" and function in _ALGEBRAIC_REDUCTIONS:
                combine = getattr(self._poly, _ALGEBRAIC_REDUCTIONS[function])
                reduced = self._per_row(combine, x.movedim(dim, -1))
                return reduced.unsqueeze(-1).movedim(-1, dim)
            if head == "reduce":  # (the reduced dim kept, of size 1)
                return self._numbered((head, function), [rows]).unsqueeze(-1).movedim(-1, dim)
            places = torch.arange(x.shape[dim]).expand(x.movedim(dim, -1).shape)
            row_ids = rows.unsqueeze(-1).expand(places.shape)
            return self._numbered((head, function), [row_ids, places]).movedim(-1, dim)
        if head == "pad":
            x, dim, before, after, value = operands
            fill = torch.tensor([self._poly.constant(float(value))], dtype=torch.int64)
            shape = list(x.shape)
            parts = []
            for size in (before, after):
                shape[dim] = size
                parts.append(fill.expand(shape))
            return torch.cat([parts[0], x, parts[1]], dim)
        return None

    def _elementwise(self, head: str, attrs: tuple, row: tuple[int, ...]) -> int:
        """The id of an elementwise op's element: by the algebra where it applies, else the op's
        own."""
        value = self._poly.elementwise(head, attrs, row)
        return self._poly.code((head, *attrs, *row)) if value is None else value

    def _placed_by_index(self, term: App) -> torch.Tensor | None:
        """The ids a gather or replacing scatter with constant indices places (None for other
        ops, or indices computed from rank tensors)."""
        if term.head in PLACED_BY_INDEX:
            op, attrs, tensors = term.head, {}, [a for a in term.args if isinstance(a, App)]
        elif term.head.startswith("opaque") and isinstance(term.args[0], str):
            op, attrs = parse_op_key(term.args[0])
            tensors = list(term.args[1:])
        else:
            return None
        if op not in PLACED_BY_INDEX:
            return None
        indices = set(PLACED_BY_INDEX[op](len(tensors), attrs))
        if not indices:
            return None
        operands = [self._value(t) if i in indices else self.of(t) for i, t in enumerate(tensors)]
        if any(o is None for o in operands):
            return None
        if op == "index_put" and any(  # a slot written twice holds either value
                len(set(operands[i].reshape(-1).tolist())) < operands[i].numel()
                for i in indices if operands[i].dtype != torch.bool):
            return None
        try:
            return OPS[op].run(operands, attrs)
        except (ValueError, RuntimeError, IndexError):
            return None

    def _value(self, term: Term) -> torch.Tensor | None:
        """The value of a term over constants (None if it reads a rank tensor)."""
        if not isinstance(term, App) or leaves(term):
            return None
        env = {}
        for key in set(_CONST_KEYS.findall(render(term))):
            value = self._const_value(f'(const "{key}")')
            if value is None:
                return None
            env[key] = value
        try:
            return evaluate(term, env)
        except (ValueError, RuntimeError, KeyError):
            return None

    def _matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
        if a.dim() != b.dim() or a.dim() < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
            return None
        rows = self._rows(a).unsqueeze(-1).expand(*a.shape[:-1], b.shape[-1])
        columns = self._rows(b.transpose(-1, -2)).unsqueeze(-2).expand(rows.shape)
        if a.shape[-1] > DOT_LIMIT or self.products == "opaque":
            return self._numbered(("matmul",), [rows, columns])
        if self.products == "unexpanded":
            return self._per_element(self._unexpanded_dot, [rows, columns])
        return self._per_element(self._dot, [rows, columns])

    def _unexpanded_dot(self, pair: tuple[int, ...]) -> int:
        """A matmul element as the sum of its products, each left unexpanded."""
        return self._poly.unexpanded_dot(self._row_ids[pair[0]], self._row_ids[pair[1]])

    def _dot(self, pair: tuple[int, ...]) -> int:
        """A matmul element: the polynomial sum of the row's and column's products while it is
        at most DOT_LIMIT monomials, else the sum of its products left unexpanded. The choice
        depends on the operands' ids alone, so an element is numbered alike wherever it is
        computed alike."""
        xs, ys = self._row_ids[pair[0]], self._row_ids[pair[1]]
        if self._poly.product_size(xs, ys) > DOT_LIMIT:
            return self._poly.unexpanded_dot(xs, ys)
        return self._poly.dot(xs, ys)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """One id per row (last dim) of `x`, equal for rows of equal ids."""
        def code(row: tuple[int, ...]) -> int:
            key = self._poly.code(("row", *row))
            self._row_ids[key] = row
            return key
        return self._per_row(code, x)

    def _per_row(self, function: Callable[[tuple[int, ...]], int], x: torch.Tensor
                 ) -> torch.Tensor:
        """function(row) for each row (last dim) of `x`, once per distinct row."""
        flat = x.reshape(-1, x.shape[-1])
        unique, inverse = torch.unique(flat, dim=0, return_inverse=True)
        codes = torch.tensor([function(tuple(row)) for row in unique.tolist()], dtype=torch.int64)
        return codes[inverse].reshape(x.shape[:-1])

    def _per_element(self, function: Callable[[tuple[int, ...]], int],
                     parts: list[torch.Tensor]) -> torch.Tensor:
        """function(the parts' ids) for each element, once per distinct tuple of ids."""
        return self._per_row(function, torch.stack([p.reshape(-1) for p in parts], 1)
                             ).reshape(parts[0].shape)

    def _numbered(self, tag: tuple, parts: list[torch.Tensor]) -> torch.Tensor:
        """One id per element: the op `tag` of the parts' ids there."""
        return self._per_element(lambda row: self._poly.code((*tag, *row)), parts)

    def _constant(self, key: str) -> torch.Tensor | None:
        """A constant's ids: its numbers' where its value is known, else fresh."""
        value = self._const_value(key)
        if value is None or value.numel() > ELEMENT_LIMIT or value.is_complex():
            return self._fresh(self._const_shape(key))
        numbers, inverse = torch.unique(value, return_inverse=True)
        if numbers.numel() > CONSTANT_VALUES:
            return self._fresh(self._const_shape(key))
        ids = torch.tensor([self._poly.constant(n) for n in numbers.tolist()], dtype=torch.int64)
        return ids[inverse].reshape(value.shape)

    def _of_name(self, name: str) -> torch.Tensor | None:
        if name in self._pieces and name not in self._ids:
            self._ids[name] = self._held(name, self._pieces[name])
        if name not in self._ids:
            self._ids[name] = None  # while its definition is numbered
            definition = None
            if self._depth < DEPTH and self._spent < BUDGET:
                definition = self._definition(name)
            ids = None
            if definition is not None:
                self._depth += 1
                try:
                    ids = self.of(definition)
                finally:
                    self._depth -= 1
            if self.over_budget:  # not kept: a later query, with a budget of its own, numbers it
                del self._ids[name]
                return ids if ids is not None else self._fresh(self._shape_of(name))
            self._ids[name] = ids if ids is not None else self._fresh(self._shape_of(name))
            self.held += 0 if self._ids[name] is None else self._ids[name].numel()
        return self._ids[name]

    def _held(self, name: str, pieces: list[HeldPiece]) -> torch.Tensor | None:
        ids = self._fresh(self._shape_of(name))
        for piece in pieces:
            key = f"reference {piece.target}"
            if key not in self._ids:
                self._ids[key] = self._fresh(piece.ref_shape)
            if ids is None or self._ids[key] is None:
                return None
            ids.narrow(piece.dim, piece.local_start, piece.size).copy_(
                self._ids[key].narrow(piece.dim, piece.ref_start, piece.size))
        return ids

    def _fresh(self, shape: Shape | None) -> torch.Tensor | None:
        if shape is None or prod(shape) > ELEMENT_LIMIT:
            return None
        start = self._poly.fresh(prod(shape))
        return torch.arange(start, start + prod(shape), dtype=torch.int64).reshape(shape)


def numbered_definition(encoded: str, deterministic: bool) -> Term | None:
    """A rank tensor's definition (its encoded node) for numbering; None for a random draw."""
    return parse(encoded) if deterministic else None


def follow_elements(value: str, candidates: list[Node], origins: Origins,
                    order: dict[str, int], latest: bool = False) -> str | None:
    """A movement term over `candidates` (rank tensors) equal to the term `value`, or None when
    some element of `value` is held by none of them. Of tensors holding as many of its elements,
    the earliest is taken, or with `latest` the last the ranks computed (their final layout)."""
    ids = origins.of_resumed(parse(value))
    if ids is None or ids.numel() == 0:
        return None
    wanted = set(ids.reshape(-1).tolist())
    holders: list[tuple[int, dict[int, int]]] = []  # per candidate: the wanted ids it holds
    for index, candidate in sorted(enumerate(candidates), key=lambda c: order.get(c[1].name, 0),
                                   reverse=latest):
        theirs = origins.of(App("dist", (candidate.name,)))
        if theirs is not None:
            places: dict[int, int] = {}
            for flat, element in enumerate(theirs.reshape(-1).tolist()):
                if element in wanted:
                    places.setdefault(element, flat)
            if places:
                holders.append((index, places))
    held = _covered(holders, len(wanted))
    if held is None:
        return None
    hits = [held[element] for element in ids.reshape(-1).tolist()]
    which = torch.tensor([i for i, _ in hits]).reshape(ids.shape)
    where = torch.tensor([f for _, f in hits]).reshape(ids.shape)
    term = _laid_out(which, where, candidates, order)
    if term is None:  # equal elements read from scattered places: look for affine ones, in
        # the tensors that hold most of the value (its repeated elements where they belong)
        whole = _covered(holders, len(wanted), whole_first=True)
        used = sorted({index for index, _ in whole.values()})
        term = _laid_out_affinely(ids, used, candidates, origins, order)
    return term


def _covered(holders: list[tuple[int, dict[int, int]]], wanted: int, whole_first: bool = False
             ) -> dict[int, tuple[int, int]] | None:
    """Each wanted id -> (candidate, flat index) in the fewest candidates: the one holding most of
    the rest first (with `whole_first`, of those, the one holding most of all), or None."""
    held: dict[int, tuple[int, int]] = {}
    while len(held) < wanted:
        index, places = max(holders, key=lambda h: (sum(e not in held for e in h[1]),
                                                    len(h[1]) if whole_first else 0),
                            default=(None, {}))
        fresh = {e: (index, flat) for e, flat in places.items() if e not in held}
        if not fresh:
            return None
        held.update(fresh)
    return held


def _laid_out_affinely(ids: torch.Tensor, used: list[int], candidates: list[Node],
                       origins: Origins, order: dict[str, int]) -> str | None:
    """The term laying out `ids` from the `used` candidates at places affine in its dims
    (places.py), when some of its elements are held at several places."""
    used = sorted(used, key=lambda i: order.get(candidates[i].name, 0))
    held = [origins.of(App("dist", (candidates[i].name,))).reshape(-1) for i in used]
    places = affine_places(ids, torch.cat(held))
    if places is None:
        return None
    ends = torch.tensor([t.numel() for t in held]).cumsum(0)
    position = torch.searchsorted(ends, places, right=True)
    starts = ends - torch.tensor([t.numel() for t in held])
    which = torch.tensor(used)[position]
    return _laid_out(which, places - starts[position], candidates, order)


def _laid_out(which: torch.Tensor, where: torch.Tensor, candidates: list[Node],
              order: dict[str, int]) -> str | None:
    """The term laying the candidates' elements out as `which` (the candidate) and `where` (the
    flat index in it) say, per element."""
    used = sorted(set(which.reshape(-1).tolist()), key=lambda i: order.get(candidates[i].name, 0))
    nodes = [candidates[i] for i in used]
    if len({c.shape for c in nodes}) == 1:
        stacked = [f"(unsqueeze {leaf(c.name)} 0)" for c in nodes]
        source = leaf(nodes[0].name) if len(nodes) == 1 else concat_terms(stacked, [1] * len(nodes), 0)
        shape = nodes[0].shape if len(nodes) == 1 else (len(nodes), *nodes[0].shape)
    else:
        source = concat_terms([_flattened(leaf(c.name), c.shape) for c in nodes],
                              [prod(c.shape) for c in nodes], 0)
        shape = (sum(prod(c.shape) for c in nodes),)
    starts, start = {}, 0
    for index, candidate in zip(used, nodes):
        starts[index] = start
        start += prod(candidate.shape)
    offsets = torch.tensor([starts.get(i, 0) for i in range(len(candidates))])
    term = layout_term(parse(source), tuple(shape), offsets[which] + where)
    return None if term is None else render(term)


def _flattened(term: str, shape: Shape) -> str:
    for dim in reversed(range(len(shape) - 1)):
        term = f"(merge {term} {dim} {prod(shape[dim + 1:])})"
    return term


def replicas_of(relations: list[Relation]) -> dict[str, str]:
    """The rank tensors the relations name as copies of another rank tensor."""
    copies = {}
    for relation in relations:
        for term, name in relation.facts():
            source = parse(term)
            if isinstance(source, App) and source.head == "dist" and source.args[0] != name:
                copies[name] = source.args[0]
    return copies
