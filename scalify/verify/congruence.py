"""Relations found without an e-graph window, by congruence over a symbolic (rank-family) program.

When a rank node applies the reference op, with the same attributes, to the rank tensors the
inputs' relations name, it holds the reference value (inputs replicated), or every rank's
share of it along the same dim (inputs `(rcat x d s)`, for ops that act on each share alone:
elementwise ops, data movement and reductions off the split dim, matrix products over
uncontracted dims), or a rank's summand of it (a matrix product contracting the split dim; data
movement of `(rsum x)`, which is linear, padding with zeros included). An all-reduce of `x`
holds `(rsum x)` whole. Anything else is left to the windows.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Node
from ..ir.ops import BINARY, MATMUL, MOVEMENT, OPS, REDUCE, SOFTMAX, UNARY, WHERE
from ..rules.terms import App, Term, parse
from .relations import Relation


@dataclass(frozen=True)
class Part:
    """An input's relation as a rank tensor `name`: the value itself ("dist"), every rank's
    share along `dim` of size `size` ("rcat"), a rank's summand ("rsum"), the value
    broadcast along `dim` to `size` ("bcast"), or a broadcast constant (`name` is its term)."""

    kind: str
    name: str
    dim: int = -1
    size: int = 0


def part_of(term: str) -> Part | None:
    app = parse(term)
    if not isinstance(app, App):
        return None
    if app.head == "expand" and '(dist "' not in term:  # a broadcast constant
        return Part("const", term)
    if app.head == "dist":
        return Part("dist", str(app.args[0]).strip('"'))
    inner = app.args[0] if app.args else None
    if not (isinstance(inner, App) and inner.head == "dist"):
        return None
    name = str(inner.args[0]).strip('"')
    if app.head == "expand":
        return Part("bcast", name, int(str(app.args[1])), int(str(app.args[2])))
    if app.head == "rcat":
        return Part("rcat", name, int(str(app.args[1])), int(str(app.args[2])))
    return Part("rsum", name) if app.head == "rsum" else None


def _moved(node: Node, dim: int, size: int) -> tuple[int, int] | None:
    """Where a one-input movement op puts the split dim `dim` (shares of `size`), if it acts on
    each share alone."""
    op, a = node.op, dict(node.attrs)
    if op in ("slice", "expand", "pad"):
        return (dim, size) if a["dim"] != dim else None
    if op == "transpose":
        return ({a["dim0"]: a["dim1"], a["dim1"]: a["dim0"]}.get(dim, dim), size)
    if op == "unsqueeze":
        return (dim + (a["dim"] <= dim), size)
    if op == "squeeze":
        return (dim - (a["dim"] < dim), size) if a["dim"] != dim else None
    if op == "split":
        if a["dim"] == dim:
            return (dim, size // a["inner"]) if size % a["inner"] == 0 else None
        return (dim + (a["dim"] < dim), size)
    if op == "merge":
        if a["dim"] == dim:
            return (dim, size * a["inner"])
        return (dim - (a["dim"] + 1 < dim), size) if a["dim"] + 1 != dim else None
    return None


def _split_dim(node: Node, parts: list[Part]) -> tuple[int, int] | None:
    """The output's split dim and share size when every operand is split alike and the op
    acts on each share alone; None otherwise."""
    trait = OPS[node.op].trait
    split = {(p.dim, p.size) for p in parts if p.kind == "rcat"}
    if len(split) != 1:
        return None
    dim, size = split.pop()
    if trait in (UNARY, BINARY, WHERE):  # broadcasts along the split dim shrink to a share
        if any(p.kind not in ("rcat", "const") and (p.kind, p.dim) != ("bcast", dim)
               for p in parts):
            return None
        return dim, size
    if node.op == "concat":
        return (dim, size) if all(p.kind == "rcat" for p in parts) and node.attr("dim") != dim \
            else None
    if trait in (REDUCE, SOFTMAX):
        return (dim, size) if node.attr("dim") != dim else None
    if trait == MOVEMENT and len(parts) == 1:
        return _moved(node, dim, size)
    if trait == MATMUL:
        rank = len(node.shape)
        left, right = parts
        if left.kind == "rcat" and right.kind == "rcat":
            return (dim, size) if dim < rank - 2 else None
        if left.kind == "rcat" and right.kind == "dist" and dim == rank - 2:
            return dim, size
        if left.kind == "dist" and right.kind == "rcat" and dim == rank - 1:
            return dim, size
    return None


def _contracts_split_dim(node: Node, parts: list[Part]) -> bool:
    """A matrix product of operands split alike along the dim it contracts."""
    if node.op != "matmul" or any(p.kind != "rcat" for p in parts):
        return False
    rank, (left, right) = len(node.shape), parts
    return (left.dim, right.dim, left.size) == (rank - 1, rank - 2, right.size)


def _twins(node: Node, names: list[set[str]], shape: tuple[int, ...], dist: Graph,
           users: dict[str, list[str]], order: dict) -> list[str]:
    """Rank nodes applying `node`'s op and attributes to the given rank tensors, of `shape`."""
    candidates = {user for options in names for name in options for user in users[name]}
    wanted = (node.op, node.attrs, shape, node.dtype)
    found = [c for c in candidates
             if (dist[c].op, dist[c].attrs, dist[c].shape, dist[c].dtype) == wanted
             and len(dist[c].inputs) == len(names)
             and all(arg in options for arg, options in zip(dist[c].inputs, names))]
    return sorted(found, key=order.get)


def replicated_twins(node: Node, inputs: list[Relation], dist: Graph, users: dict[str, list[str]],
                     constants: dict[str, set[str]], order: dict) -> list[str]:
    """Rank nodes applying `node`'s op to rank tensors equal to the inputs (each input a rank
    tensor, one of its replicas, or a constant equal to the reference's); `constants` holds the
    rank nodes of each constant term."""
    equal: list[set[str]] = []
    for relation in inputs:
        part = part_of(relation.term)
        if relation.pending is not None or part is not None and part.kind not in ("dist", "const",
                                                                                   "rsum"):
            return []
        if part is not None and part.kind == "dist":
            equal.append({part.name, *(n for t, n in relation.aliases if t == relation.term)})
        elif part is not None and part.kind == "rsum":  # the all-reduces of that summand
            equal.append({u for u in users[part.name] if dist[u].op == "all_reduce"
                          and dist[u].attr("reduce") == "sum" and dist[u].attr("family")})
        else:
            equal.append(set(constants.get(relation.term, ())))
    if not any(equal) or not all(equal):
        return []
    return _twins(node, equal, node.shape, dist, users, order)


def _unfolded(part: Part, dist: Graph) -> Part:
    """A whole rank tensor that is itself a broadcast, as that broadcast."""
    if part.kind != "dist" or dist[part.name].op != "expand":
        return part
    node = dist[part.name]
    return Part("bcast", node.inputs[0], node.attr("dim"), node.attr("size"))


def _shrunk(term: Term, dim: int, size: int) -> Term | None:
    """A broadcast chain with its broadcast along `dim` cut to `size` (None: there is none)."""
    if not (isinstance(term, App) and term.head == "expand"):
        return None
    inner, along, full = term.args
    if along == dim:  # a broadcast to one element is no broadcast at all
        return inner if size == 1 else App("expand", (inner, along, size))
    shrunk = _shrunk(inner, dim, size)
    return App("expand", (shrunk, along, full)) if shrunk is not None else None


def _options(part: Part, dim: int, size: int, dist: Graph, users: dict[str, list[str]],
             replicas: dict[str, set[str]], constants: dict[str, set[str]]) -> set[str]:
    """The rank tensors a twin may read where the reference reads `part`."""
    if part.kind == "rcat":
        return {part.name}
    if part.kind == "dist":
        return {part.name, *replicas.get(part.name, ())}
    if part.kind == "bcast":
        return _broadcasts({part.name, *replicas.get(part.name, ())}, dim, size, dist, users)
    shrunk = _shrunk(parse(part.name), dim, size)
    return set(constants.get(str(shrunk), ())) if shrunk is not None else set()


def rank_concat_relation(node: Node, terms: list[str], dist: Graph, users: dict[str, list[str]],
                         order: dict, replicas: dict[str, set[str]],
                         constants: dict[str, set[str]]) -> str | None:
    """`(rcat twin d s)` or `(rsum twin)` for a rank node computing every rank's share or
    summand of `node`'s value, or None. `replicas` holds the rank tensors known equal to each,
    `constants` the rank nodes of each constant term."""
    parts = [part_of(term) for term in terms]
    if not parts or any(p is None for p in parts):
        return None
    if OPS[node.op].trait in (UNARY, BINARY, WHERE) and any(p.kind == "rcat" for p in parts):
        parts = [_unfolded(p, dist) for p in parts]
    if all(p.kind == "rsum" for p in parts):  # movement is linear: a summand moves alone
        if len(parts) != 1 or OPS[node.op].trait != MOVEMENT or node.attr("value", 0) != 0:
            return None
        twins = _twins(node, [{parts[0].name}], node.shape, dist, users, order)
        return f'(rsum (dist "{twins[0]}"))' if twins else None
    if _contracts_split_dim(node, parts):  # partial products: each rank's is a summand
        twins = _twins(node, [{p.name} for p in parts], node.shape, dist, users, order)
        return f'(rsum (dist "{twins[0]}"))' if twins else None
    split = _split_dim(node, parts)
    if split is None:
        return None
    dim, size = split
    shape = node.shape[:dim] + (size,) + node.shape[dim + 1:]
    options = [_options(p, dim, size, dist, users, replicas, constants) for p in parts]
    twins = _twins(node, options, shape, dist, users, order)
    return f'(rcat (dist "{twins[0]}") {dim} {size})' if twins else None


def _broadcasts(names: set[str], dim: int, size: int, dist: Graph,
                users: dict[str, list[str]]) -> set[str]:
    """Rank nodes broadcasting any of `names` along `dim` to `size` (to one element: the
    names themselves, whose dim has that size)."""
    if size == 1:
        return set(names)
    return {u for name in names for u in users[name] if dist[u].op == "expand"
            and (dist[u].attr("dim"), dist[u].attr("size")) == (dim, size)}


def broadcast_term(node: Node, terms: list[str]) -> str | None:
    """`(expand x d n)` / `(unsqueeze x d)` of a rank tensor x that holds the whole input: a
    relation by itself (the ranks may broadcast it to other sizes)."""
    part = part_of(terms[0]) if len(terms) == 1 else None
    if part is None or part.kind != "dist" or node.op not in ("expand", "unsqueeze"):
        return None
    if node.op == "unsqueeze":
        return f"(unsqueeze {terms[0]} {node.attr('dim')})"
    return f"(expand {terms[0]} {node.attr('dim')} {node.attr('size')})"
