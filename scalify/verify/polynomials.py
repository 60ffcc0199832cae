"""Canonical integer ids for values that are polynomials in other values (value numbering with
algebra).

An id names a value. Values no rule below computes (a rank input, a nonlinear op's output) are
atoms. Sums, differences, scalings by exact fractions, partial sums over ranks and products are
written as polynomials in atoms with exact rational coefficients, and a polynomial's id is
that of its canonical form: its monomials (sorted products of atoms) with their coefficients,
sorted. So a contraction split across ranks and summed (`psum` of two half matmuls), a bias
added to both halves of a partial sum as half of itself, or a gradient averaged before or
after it is summed, get the id of the reference's value. The arithmetic is that of the reals,
as the e-graph's rules assume (a sum reassociated is the same sum).

A product by a monomial is always expanded (a scaled sum stays a sum); a product of two sums only
while small (`EXPANSION_LIMIT` monomials); past it it is a monomial of its factors' normalized
forms, which is still exact (equal ids are equal values),
only fewer equalities are seen. Every monomial built counts against `work`, which a caller
bounds.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable

from ..ir.scaling import exact_fraction
from ..rules.terms import literal_value, parse_op_key

Number = int | Fraction  # a coefficient: an int while it is one (faster than a Fraction)
Terms = tuple[tuple[int, Number], ...]  # sorted (monomial id, coefficient), none zero
EXPANSION_LIMIT = 16  # monomials a product of two sums may expand to (by a monomial: any)
_SIGNED = {"neg": -1}
_SCALINGS = frozenset({"mul_scalar", "div_scalar"})
_SUMS = {"add": (1, 1), "sub": (1, -1)}
_POWERS = (2, 3, 4)  # integer powers written as products


class OverBudget(Exception):
    """Numbering did more work than its limit allows."""


class Polynomials:
    """The id table: `code` interns any key; polynomials are interned by their canonical form."""

    def __init__(self) -> None:
        self._codes: dict[tuple, int] = {}
        self._terms: dict[int, Terms] = {}  # a polynomial id (not a lone atom) -> its terms
        self._factors: dict[int, tuple[int, ...]] = {}  # a monomial id (not an atom) -> factors
        self._roots: dict[int, int] = {}  # the square root of a sum of squares -> that sum
        self._nonnegative: set[int] = set()  # squares and positive sums of them
        self._products: dict[tuple[int, int], int] = {}
        self._normal_forms: dict[int, tuple[Number, int]] = {}  # a value -> `_normalized` of it
        self._max_of: dict[int, frozenset[int]] = {}  # the largest of several values -> them
        self._next = 0
        self.work = 0
        self.limit = 1 << 62  # work past which numbering stops (`OverBudget`)
        self.stored = 0  # terms held by the table (its memory)
        self.one = self.code(("monomial", ()))  # the empty product
        self._factors[self.one] = ()
        self.zero = self.of_terms({})

    def code(self, key: tuple) -> int:
        """The id of the value `key` names (a new one the first time)."""
        if key not in self._codes:
            self._codes[key] = self._next
            self._next += 1
        return self._codes[key]

    def fresh(self, count: int) -> int:
        """The first of `count` new atom ids."""
        start = self._next
        self._next += count
        return start

    def terms(self, value: int) -> Terms:
        return self._terms.get(value, ((value, 1),))

    def of_terms(self, terms: dict[int, Number]) -> int:
        """The id of the polynomial with these terms."""
        canonical = tuple(sorted((m, c) for m, c in terms.items() if c != 0))
        if len(canonical) == 1 and canonical[0][1] == 1:
            return canonical[0][0]
        value = self.code(("polynomial", canonical))
        if value not in self._terms:
            self._terms[value] = canonical
            self.stored += len(canonical)
        return value

    def constant(self, number: float | int | bool) -> int:
        """The id of a number (a non-finite one is an atom of its own)."""
        if not math.isfinite(number):
            return self.code(("number", repr(float(number))))
        return self.of_terms({self.one: _simplest(exact_fraction(float(number)) or 0)})

    def linear(self, pairs: Iterable[tuple[Number, int]]) -> int:
        """The id of sum(coefficient * value)."""
        total: dict[int, Number] = {}
        nonnegative = True
        for coefficient, value in pairs:
            nonnegative = nonnegative and coefficient > 0 and value in self._nonnegative
            for monomial, c in self.terms(value):
                total[monomial] = total.get(monomial, 0) + coefficient * c
                self.work += 1
        if self.work > self.limit:
            raise OverBudget
        value = self.of_terms(total)
        if nonnegative and total:
            self._nonnegative.add(value)
        return value

    def product(self, x: int, y: int) -> int:
        """The id of x * y: expanded while small, else one monomial of the normalized factors."""
        key = (x, y) if x <= y else (y, x)
        if key not in self._products:
            self._products[key] = self._product(x, y)
            if x == y:
                self._nonnegative.add(self._products[key])
        return self._products[key]

    def _product(self, x: int, y: int) -> int:
        if x == y and x in self._roots:
            return self._roots[x]
        tx, ty = self.terms(x), self.terms(y)
        if min(len(tx), len(ty)) > 1 and len(tx) * len(ty) > EXPANSION_LIMIT:
            self.work += 1
            monomial, scale = self._unexpanded(x, y)
            return self.of_terms({monomial: scale})
        total: dict[int, Number] = {}
        for mx, cx in tx:
            for my, cy in ty:
                monomial = self._monomial(self._of(mx) + self._of(my))
                total[monomial] = total.get(monomial, 0) + cx * cy
                self.work += 1
        return self.of_terms(total)

    def product_size(self, xs: Iterable[int], ys: Iterable[int]) -> int:
        """How many monomials sum(x * y) multiplies out before like terms combine."""
        return sum(len(self.terms(x)) * len(self.terms(y)) for x, y in zip(xs, ys))

    def dot(self, xs: Iterable[int], ys: Iterable[int]) -> int:
        """The id of sum(x * y) over pairs (a matmul's element)."""
        total: dict[int, Number] = {}
        for x, y in zip(xs, ys):
            for monomial, c in self.terms(self.product(x, y)):
                total[monomial] = total.get(monomial, 0) + c
            if self.work > self.limit:
                raise OverBudget
        return self.of_terms(total)

    def unexpanded_dot(self, xs: Iterable[int], ys: Iterable[int]) -> int:
        """The id of sum(x * y) with each product one monomial of its normalized factors (a
        matmul element too large to multiply out): as many terms as pairs, so a contraction
        split across ranks and summed still gets the reference's id."""
        total: dict[int, Number] = {}
        for x, y in zip(xs, ys):
            if self.zero in (x, y):
                continue
            monomial, scale = self._unexpanded(x, y)
            total[monomial] = total.get(monomial, 0) + scale
            self.work += 1
        if self.work > self.limit:
            raise OverBudget
        return self.of_terms(total)

    def sum_of(self, values: Iterable[int]) -> int:
        """The id of the sum of `values`."""
        return self.linear((1, v) for v in values)

    def maximum(self, values: Iterable[int]) -> int:
        """The id of the largest of `values`, one per set of values: the largest of values that
        are themselves largest of others is the largest of all of those (max is idempotent,
        commutative and associative), so a maximum split over ranks gets the whole one's id."""
        members: set[int] = set()
        for value in values:
            members |= self._max_of.get(value, {value})
        if len(members) == 1:
            return next(iter(members))
        value = self.code(("max", tuple(sorted(members))))
        if value not in self._max_of:
            self._max_of[value] = frozenset(members)
            self.stored += len(members)
        return value

    def elementwise(self, head: str, attrs: tuple, values: tuple[int, ...]) -> int | None:
        """The id of an elementwise op the algebra knows, or None (then the op is an atom)."""
        if head == "psum":
            return self.sum_of(values)
        if head == "pmax":
            return self.maximum(values)
        if head == "unary":
            op, op_attrs = parse_op_key(attrs[0])
            if op == "sqrt" or op == "pow_scalar" and op_attrs.get("value") == 0.5:
                return self.square_root(values[0])
            if op == "pow_scalar" and op_attrs.get("value") in _POWERS:
                power = values[0]
                for _ in range(int(op_attrs["value"]) - 1):
                    power = self.product(power, values[0])
                return power
            factor = _SIGNED.get(op) if op not in _SCALINGS else _scalar(op, op_attrs)
            return None if factor is None else self.linear([(_simplest(factor), values[0])])
        if head == "binary":
            op, op_attrs = parse_op_key(attrs[0])
            if op in _SUMS and not op_attrs:
                return self.linear(zip(_SUMS[op], values))
            if op == "mul" and not op_attrs:
                return self.product(*values)
            return None
        if head == "where3" and values[0] in (self.one, self.zero):  # a constant condition
            return values[1] if values[0] == self.one else values[2]
        if head == "masked_fill":  # by a constant mask
            x, mask = values
            if mask == self.zero:
                return x
            if mask == self.one:
                return self.constant(_number(attrs[0]))
        return None

    def square_root(self, x: int) -> int:
        """The id of sqrt(x); its square is x where x is never negative: a square, a sum of
        squares with positive coefficients (however its products were multiplied out), or a
        polynomial whose monomials are all squares with positive coefficients."""
        root = self.code(("sqrt", x))
        if x in self._nonnegative or all(
                c > 0 and all(self._of(m).count(f) % 2 == 0 for f in set(self._of(m)))
                for m, c in self.terms(x)):
            self._roots[root] = x
            self._nonnegative.add(root)
        return root

    def _unexpanded(self, x: int, y: int) -> tuple[int, Number]:
        """x * y as one monomial of the normalized factors, and its coefficient."""
        (sx, ux), (sy, uy) = self._normalized(x), self._normalized(y)
        return self._monomial(self._of(ux) + self._of(uy)), sx * sy

    def _normalized(self, value: int) -> tuple[Number, int]:
        """value as scale * (a polynomial whose first coefficient is 1), once per value."""
        if value not in self._normal_forms:
            terms = self.terms(value)
            scale = terms[0][1]
            self._normal_forms[value] = (1, value) if scale == 1 else (scale, self.of_terms(
                {m: _simplest(Fraction(c) / scale) for m, c in terms}))
        return self._normal_forms[value]

    def _of(self, monomial: int) -> tuple[int, ...]:
        return self._factors.get(monomial, (monomial,))

    def _monomial(self, factors: tuple[int, ...]) -> int:
        factors = tuple(sorted(factors))
        if len(factors) == 1:
            return factors[0]
        value = self.code(("monomial", factors))
        self._factors[value] = factors
        return value


def _scalar(op: str, attrs: dict) -> Fraction | None:
    value = exact_fraction(attrs.get("value"))
    return value if value is None or op == "mul_scalar" else 1 / value


def _simplest(number: Number) -> Number:
    """An integral coefficient as an int."""
    return int(number) if isinstance(number, Fraction) and number.denominator == 1 else number


def _number(literal: str) -> float:
    return float(literal_value(literal))
