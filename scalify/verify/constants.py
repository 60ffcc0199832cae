"""Where a program's constants come from, and their shapes, as facts a window may state.

A constant is a `(const "key")` leaf named by its value, so the reference's table and a rank's
table of the same values are one term. A constant cut or rearranged from another one (a rank's
chunk of a rotary table built whole, then viewed and split into its cos and sin halves) has a
value of its own, and its leaf alone says nothing of the whole table it came from. Its origin,
the movement op applied to the source constant's term, says that: stated where the leaf
appears, each rank's chunk is a slice of the reference's table. A constant computed on its
own (a rank's causal mask from its own query positions) whose value is a block of another
one's (the reference's whole mask) is that block's slice: checked on the values. A negative
number is the negation of its positive one; a constant of ones says so (a product with it is
the other operand).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch

from ..ir.distributed import value_key
from ..ir.graph import Graph
from ..ir.ops import MOVEMENT, OPS
from ..rules.terms import shape_facts, uniform_literal
from .encode import encode

_CONST = re.compile(r'\(const "[0-9a-f]+"\)')
GRID_BLOCKS = 4096  # blocks of a grid compared at most (a causal mask's, by key chunk)
Cuts = tuple[tuple[int, int, int], ...]  # (dim, start, size) of a block, per cut dim


@dataclass
class ConstantOrigins:
    """The origins (movement ops over other constants' terms), shapes and values of constant
    leaves."""

    origins: dict[str, set[str]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, graph: Graph, terms: dict[str, str],
            values: dict[str, torch.Tensor | None]) -> None:
        """The constant leaves of `graph`, whose node terms are `terms` and values `values`
        (`constant_values`)."""
        for node in graph:
            term = terms.get(node.name)
            if term is not None and values.get(node.name) is not None:
                self._add_uniform_leaf(term, values[node.name])
            if term is None or not _CONST.fullmatch(term):
                continue
            self.shapes[term] = node.shape
            if values.get(node.name) is not None:
                self.values[term] = values[node.name]
            if (OPS[node.op].trait != MOVEMENT or not node.inputs
                    or any(i not in terms for i in node.inputs)):
                continue
            origin = encode(node, [terms[i] for i in node.inputs],
                            [graph[i].shape for i in node.inputs])
            if origin != term:
                self.origins.setdefault(term, set()).add(origin)

    def _add_uniform_leaf(self, term: str, value: torch.Tensor) -> None:
        """The value of the leaf a broadcast of one value is built on (`constant_terms`)."""
        leaves = _CONST.findall(term)
        if len(leaves) == 1 and leaves[0] != term and leaves[0] not in self.values:
            self.values[leaves[0]] = value.reshape(-1)[:1].reshape((1,) * value.dim())

    def _negations(self, term: str) -> list[str]:
        """A negative number's leaf as the negation of the positive one's (`-1 / 12` written by
        one program, `1 / 12` negated by the other)."""
        value = self.values.get(term)
        if value is None or value.numel() != 1 or not value.is_floating_point() or value.item() >= 0:
            return []
        dtype = str(value.dtype).removeprefix("torch.")
        positive = f'(const "{value_key(tuple(value.shape), dtype, -value)}")'
        self.values.setdefault(positive, -value)
        return [f'(union {term} (unary "neg" {positive}))']

    def _ones(self, term: str) -> list[str]:
        """Whether a leaf's elements are all 1 (a product with it is the other operand)."""
        value = self.values.get(term)
        ones = value is not None and value.is_floating_point() and bool((value == 1).all())
        return [f"(ones {term})"] if ones else []

    def facts(self, text: str, counts: bool) -> list[str]:
        """The shape of every constant leaf in `text` and its unions with its origins, and
        the same of the leaves those name in turn; then which of them are blocks of others."""
        facts, seen = [], {}
        pending = _CONST.findall(text)
        while pending:
            term = pending.pop()
            if term in seen:
                continue
            seen[term] = None
            facts += shape_facts(term, self.shapes[term], counts) if term in self.shapes else []
            negations = self._negations(term)
            facts += negations + self._ones(term) + self._uniform(term)
            pending += [leaf for fact in negations for leaf in _CONST.findall(fact)]  # its positive
            for origin in sorted(self.origins.get(term, ())):
                facts.append(f"(union {term} {origin})")
                pending += _CONST.findall(origin)
        grids = set()
        for part, whole in itertools.permutations(seen, 2):
            for cuts in self._blocks(part, whole):
                facts.append(f"(union {part} {_sliced(whole, cuts)})")
                if len(cuts) > 1:
                    grids.add((whole, tuple((dim, size) for dim, _, size in cuts)))
        return facts + [fact for whole, sizes in sorted(grids)
                        for fact in self._uniform_blocks(whole, dict(sizes))]

    def _uniform(self, term: str) -> list[str]:
        """Whether a leaf's elements are all one value (a fill, a mask all true or all false)."""
        value = self.values.get(term)
        literal = None if value is None else uniform_literal(value)
        return [] if literal is None else [f'(uniform {term} "{literal}")']

    def _uniform_blocks(self, whole: str, sizes: dict[int, int]) -> list[str]:
        """The blocks of `whole`'s grid (blocks of `sizes` along their dims) whose elements are
        one value: a causal mask's blocks wholly in the future (which ranks skip) or past."""
        large = self.values[whole]
        block = tuple(sizes.get(d, n) for d, n in enumerate(large.shape))
        facts = []
        for cuts in _grid(large.shape, block, sorted(sizes)):
            literal = uniform_literal(_block_of(large, cuts))
            if literal is not None:
                facts.append(f'(uniform {_sliced(whole, cuts)} "{literal}")')
        return facts

    def _blocks(self, part: str, whole: str) -> list[Cuts]:
        """Where `part`'s value is a block of `whole`'s: cut along one dim, the first place it
        is; cut along several (a rank's block of a causal mask: its queries' rows, a key
        chunk's columns; a chunk, more than one element along each), every place on the grid
        of blocks of its size."""
        small, large = self.values.get(part), self.values.get(whole)
        if small is None or large is None or small.dtype != large.dtype or small.dim() != large.dim():
            return []
        cut = [d for d in range(small.dim()) if small.shape[d] != large.shape[d]]
        if not cut or any(small.shape[d] > large.shape[d] for d in cut):
            return []
        if len(cut) == 1:
            dim, size = cut[0], small.shape[cut[0]]
            return [((dim, start, size),) for start in range(large.shape[dim] - size + 1)
                    if torch.equal(large.narrow(dim, start, size), small)][:1]
        if any(small.shape[d] == 1 for d in cut):  # single elements (a broadcast's leaf)
            return []
        return [cuts for cuts in _grid(large.shape, small.shape, cut)
                if torch.equal(_block_of(large, cuts), small)]


def _grid(shape: tuple[int, ...], block: tuple[int, ...], dims: list[int]) -> list[Cuts]:
    """The blocks of size `block` that tile `shape` along `dims` (none past GRID_BLOCKS)."""
    if any(shape[d] % block[d] for d in dims):
        return []
    counts = [shape[d] // block[d] for d in dims]
    total = 1
    for count in counts:
        total *= count
    if total > GRID_BLOCKS:
        return []
    return [tuple((d, i * block[d], block[d]) for d, i in zip(dims, index))
            for index in itertools.product(*(range(count) for count in counts))]


def _block_of(value: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    for dim, start, size in cuts:
        value = value.narrow(dim, start, size)
    return value


def _sliced(term: str, cuts: Cuts) -> str:
    for dim, start, size in cuts:
        term = f"(slice {term} {dim} {start} {start + size})"
    return term
