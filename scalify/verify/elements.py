"""Relations found by following elements through data movement.

A reference op whose inputs' relations are data movement of rank tensors (the heads regrouped
by an all-to-all, a batch merged with heads, kv heads repeated) often has ranks that apply the
same op to the same elements, laid out another way, where rewriting the two layouts into one
takes an e-graph many steps. Here every element is followed instead: each rank tensor that no
data movement defines (a base) gets distinct integer ids, and the ids of a movement term are
its value on them. An op acts on blocks of its inputs (one element for an elementwise op, a row
for a softmax or a reduction, a matrix for a matmul) independently over the other dims, so a
rank op with the same attributes whose input blocks hold exactly the ids of a reference block
computes that block's output. When every reference block is found so, the reference output is
the ranks' outputs laid out as the blocks were found (layout.py), and the relation is exact.
Replicas the inputs' relations name (`Relation.aliases`) count as the tensor they copy.
"""
from __future__ import annotations

from math import prod
from typing import Callable

import torch

from ..ir.graph import Node
from ..ir.ops import BINARY, MATMUL, OPS, REDUCE, SOFTMAX, UNARY, WHERE
from ..rules.terms import App, Term, evaluate, parse, render
from .layout import layout_term
from .relations import Relation, concat_terms, leaf

Shape = tuple[int, ...]
MOVES = frozenset({"concat", "slice", "expand", "unsqueeze", "squeeze", "merge", "split",
                   "transpose"})
ELEMENT_LIMIT = 1 << 22  # ids followed per term; larger tensors are left to the e-graph


class Origins:
    """The ids of rank tensors' elements: fresh ones for a base tensor, the moved ids of its
    definition for a rank tensor defined by data movement."""

    def __init__(self, definition: Callable[[str], Term | None], shape_of: Callable[[str], Shape],
                 const_shape: Callable[[str], Shape | None], replicas: dict[str, str]) -> None:
        self._definition, self._shape_of, self._const_shape = definition, shape_of, const_shape
        self._replicas = replicas  # a replica's name -> the name of the tensor it copies
        self._ids: dict[str, torch.Tensor | None] = {}
        self._next = 0

    def of(self, term: Term) -> torch.Tensor | None:
        """The ids of a movement term over rank tensors and constants, or None (another op, or
        too many elements)."""
        if not isinstance(term, App):
            return None
        if term.head == "dist":
            return self._of_name(self._replicas.get(term.args[0], term.args[0]))
        if term.head == "const":
            return self._const(render(term))
        if term.head not in MOVES:
            return None
        args, env = [], {}
        for position, arg in enumerate(term.args):
            if isinstance(arg, App):
                ids = self.of(arg)
                if ids is None:
                    return None
                env[f"a{position}"] = ids
                args.append(f"?a{position}")
            else:
                args.append(arg)
        try:
            ids = evaluate(App(term.head, tuple(args)), env)
        except ValueError:
            return None
        return ids if ids.numel() <= ELEMENT_LIMIT else None

    def _of_name(self, name: str) -> torch.Tensor | None:
        if name not in self._ids:
            definition = self._definition(name)
            self._ids[name] = (self.of(definition) if definition is not None
                               else self._fresh(self._shape_of(name)))
        return self._ids[name]

    def _const(self, key: str) -> torch.Tensor | None:
        if key not in self._ids:
            self._ids[key] = self._fresh(self._const_shape(key))
        return self._ids[key]

    def _fresh(self, shape: Shape | None) -> torch.Tensor | None:
        if shape is None or prod(shape) > ELEMENT_LIMIT:
            return None
        ids = torch.arange(self._next, self._next + prod(shape)).reshape(shape)
        self._next += prod(shape)
        return ids


def movement_definition(encoded: str) -> Term | None:
    """A rank tensor's definition (its encoded node) when that is data movement of rank
    tensors and constants (an all-gather's and an all-to-all's are)."""
    term = parse(encoded)
    if not isinstance(term, App) or term.head not in MOVES or not _moves_only(term):
        return None
    return term


def _moves_only(term: Term) -> bool:
    if not isinstance(term, App):
        return True
    if term.head in ("dist", "const"):
        return True
    return term.head in MOVES and all(_moves_only(a) for a in term.args)


def block_dims(node: Node, ndims: list[int]) -> list[tuple[int, ...]] | None:
    """The dims of each input's block and then the output's, over which `node`'s op does not act
    independently; None for ops not applied block by block (or inputs of other dim counts)."""
    trait, ndim = OPS[node.op].trait, len(node.shape)
    if any(n != ndim for n in ndims):
        return None
    if trait in (UNARY, BINARY, WHERE) or node.op == "masked_fill":
        return [()] * (len(ndims) + 1)
    if trait in (SOFTMAX, REDUCE):
        return [(node.attr("dim") % ndim,)] * 2
    if trait == MATMUL and ndim >= 2:
        return [(ndim - 2, ndim - 1)] * 3
    return None


def _rows(ids: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """`ids` with the block dims last, one row per block."""
    width = prod(ids.shape[d] for d in block)
    moved = ids.movedim(block, tuple(range(ids.dim() - len(block), ids.dim())))
    return moved.reshape(-1, width)


def _block_shapes(ids: list[torch.Tensor], blocks: list[tuple[int, ...]]) -> tuple:
    return tuple(tuple(x.shape[d] for d in block) for x, block in zip(ids, blocks))


def follow_elements(node: Node, input_terms: list[str], candidates: list[Node],
                    origins: Origins, order: dict[str, int]) -> str | None:
    """The term over `candidates` (rank nodes applying `node`'s op with its attributes) equal to
    `node`'s value, whose inputs are `input_terms`; None when some output element is not found."""
    inputs = [origins.of(parse(term)) for term in input_terms]
    if any(ids is None for ids in inputs) or prod(node.shape) > ELEMENT_LIMIT:
        return None
    theirs = {}
    for index, candidate in enumerate(candidates):
        ids = [origins.of(App("dist", (name,))) for name in candidate.inputs]
        if all(x is not None for x in ids):
            theirs[index] = ids
    if node.op == "matmul":
        found = _matmul_sources(inputs, theirs, candidates)
    else:
        found = _block_sources(node, inputs, theirs, candidates)
    if found is None:
        return None
    which, where = found
    return _laid_out(which.reshape(node.shape), where.reshape(node.shape), candidates, order)


def _block_sources(node: Node, inputs: list[torch.Tensor], theirs: dict[int, list[torch.Tensor]],
                   candidates: list[Node]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For an op applied block by block: the candidate and the flat index in its output of each
    reference output element (row-major), or None."""
    blocks = block_dims(node, [x.dim() for x in inputs])
    if blocks is None:
        return None
    shapes = _block_shapes(inputs, blocks[:-1])
    found: dict[bytes, tuple[int, int]] = {}
    for index, ids in theirs.items():
        if (block_dims(candidates[index], [x.dim() for x in ids]) != blocks
                or _block_shapes(ids, blocks[:-1]) != shapes):
            continue
        keys = torch.cat([_rows(x, b) for x, b in zip(ids, blocks)], 1).numpy()
        for row, key in enumerate(keys):
            found.setdefault(key.tobytes(), (index, row))
    keys = torch.cat([_rows(x, b) for x, b in zip(inputs, blocks)], 1).numpy()
    hits = [found.get(key.tobytes()) for key in keys]
    if not hits or any(hit is None for hit in hits):
        return None
    block, ndim = blocks[-1], len(node.shape)
    flat = {index: _rows(torch.arange(prod(candidates[index].shape)).reshape(
        candidates[index].shape), block) for index in {i for i, _ in hits}}
    rows = torch.stack([flat[index][row] for index, row in hits])
    which = torch.tensor([index for index, _ in hits]).unsqueeze(1).expand(rows.shape)
    moved = [s for d, s in enumerate(node.shape) if d not in block] + [node.shape[d] for d in block]
    last = tuple(range(ndim - len(block), ndim))
    return tuple(x.reshape(moved).movedim(last, block).reshape(-1) for x in (which, rows))


def _matmul_sources(inputs: list[torch.Tensor], theirs: dict[int, list[torch.Tensor]],
                    candidates: list[Node]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a matmul, whose output element (b, m, n) reads row m of the left operand and column n
    of the right one in batch b: the candidate and flat output index of each element, found
    whole rows at a time (each row from one rank batch holding every column it needs) or whole
    columns at a time."""
    left, right = inputs
    if left.dim() != right.dim() or left.dim() < 2:
        return None
    a, b = left.reshape(-1, *left.shape[-2:]), right.reshape(-1, *right.shape[-2:])
    rows: dict[bytes, list[tuple[int, int, int]]] = {}
    columns: dict[bytes, list[tuple[int, int, int]]] = {}
    held: dict[tuple[int, int], tuple[dict[bytes, int], dict[bytes, int]]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for index, (their_left, their_right) in theirs.items():
        if their_left.dim() != their_right.dim() or their_left.dim() != left.dim():
            continue
        ta = their_left.reshape(-1, *their_left.shape[-2:])
        tb = their_right.reshape(-1, *their_right.shape[-2:])
        if ta.shape[2] != a.shape[2] or tb.shape[1] != b.shape[1]:
            continue
        sizes[index] = (ta.shape[1], tb.shape[2])
        for batch in range(ta.shape[0]):
            mine = ({r.tobytes(): i for i, r in enumerate(ta[batch].numpy())},
                    {c.tobytes(): i for i, c in enumerate(tb[batch].T.contiguous().numpy())})
            held[index, batch] = mine
            for key, i in mine[0].items():
                rows.setdefault(key, []).append((index, batch, i))
            for key, i in mine[1].items():
                columns.setdefault(key, []).append((index, batch, i))
    ref_rows = [[r.tobytes() for r in a[k].numpy()] for k in range(a.shape[0])]
    ref_columns = [[c.tobytes() for c in b[k].T.contiguous().numpy()] for k in range(b.shape[0])]
    for by_rows in (True, False):
        found = _whole_lines(ref_rows, ref_columns, rows if by_rows else columns, held, sizes,
                             by_rows)
        if found is not None:
            return found
    return None


def _whole_lines(ref_rows: list[list[bytes]], ref_columns: list[list[bytes]],
                 index: dict[bytes, list[tuple[int, int, int]]],
                 held: dict[tuple[int, int], tuple[dict[bytes, int], dict[bytes, int]]],
                 sizes: dict[int, tuple[int, int]], by_rows: bool
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    batches, m, n = len(ref_rows), len(ref_rows[0]), len(ref_columns[0])
    which = torch.empty(batches, m, n, dtype=torch.int64)
    where = torch.empty(batches, m, n, dtype=torch.int64)
    for batch in range(batches):
        lines, others = (ref_rows, ref_columns) if by_rows else (ref_columns, ref_rows)
        for position, key in enumerate(lines[batch]):
            for candidate, their_batch, line in index.get(key, ()):
                across = held[candidate, their_batch][1 if by_rows else 0]
                if all(k in across for k in others[batch]):
                    rows_of, columns_of = sizes[candidate]
                    crossing = torch.tensor([across[k] for k in others[batch]])
                    if by_rows:
                        flat = (their_batch * rows_of + line) * columns_of + crossing
                        which[batch, position], where[batch, position] = candidate, flat
                    else:
                        flat = (their_batch * rows_of + crossing) * columns_of + line
                        which[batch, :, position], where[batch, :, position] = candidate, flat
                    break
            else:
                return None
    return which.reshape(-1), where.reshape(-1)


def _laid_out(which: torch.Tensor, where: torch.Tensor, candidates: list[Node],
              order: dict[str, int]) -> str | None:
    """The term laying the candidates' output elements out as `which` (the candidate) and
    `where` (the flat index in its output) say, per reference output element."""
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


def replicas_of(inputs: list[Relation]) -> dict[str, str]:
    """The rank tensors the inputs' relations name as copies of another rank tensor."""
    copies = {}
    for relation in inputs:
        for term, name in relation.facts():
            source = parse(term)
            if isinstance(source, App) and source.head == "dist" and source.args[0] != name:
                copies[name] = source.args[0]
    return copies
