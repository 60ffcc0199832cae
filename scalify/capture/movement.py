"""Chains of reshapes and transposes that keep element order, in one canonical form.

A view, `einsum`'s shuffles of unit dims, `unsqueeze(...).transpose(...)` of a unit dim and a
round trip of transposes are all reshapes: every element stays in its place in row-major order.
Such a chain is rewritten from its root as one canonical reshape where that is shorter than the
code's own chain, so two programs that reshape alike hold the same nodes, however each spelled
it. Whether a chain keeps order is read by tracking the atoms (factors of the root's dims) each
dim holds. A chain that permutes elements keeps its spelling (rules relate it), unless it moves
dims by swapping them with unit dims as `einsum` does: then it becomes a reshape into the atoms, one
permutation and a reshape.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Node
from .builder import GraphBuilder, Ref

REORDERING = frozenset({"unsqueeze", "squeeze", "transpose", "merge", "split"})


@dataclass(frozen=True)
class Atoms:
    """A chain's state: its root node, the root's atoms in order (with sizes), and the atoms
    each dim of the current tensor holds (a size-1 dim holds none)."""

    root: str
    order: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]  # (atom, size)
    dims: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(root: Node) -> Atoms:
        dims = tuple((k,) if size != 1 else () for k, size in enumerate(root.shape))
        order = tuple(a for dim in dims for a in dim)
        return Atoms(root.name, order, tuple((a, root.shape[a]) for a in order), dims)

    def size(self, atom: int) -> int:
        return dict(self.sizes)[atom]

    def after(self, node: Node) -> Atoms | None:
        """The state once `node` (a reordering op on this chain's tensor) has run, or None
        when a split cuts across atoms (the chain restarts at `node`)."""
        dims = list(self.dims)
        if node.op == "unsqueeze":
            dims.insert(node.attr("dim"), ())
        elif node.op == "squeeze":
            del dims[node.attr("dim")]
        elif node.op == "transpose":
            d0, d1 = node.attr("dim0"), node.attr("dim1")
            dims[d0], dims[d1] = dims[d1], dims[d0]
        elif node.op == "merge":
            d = node.attr("dim")
            dims[d:d + 2] = [dims[d] + dims[d + 1]]
        else:
            return self._split(node.attr("dim"), node.attr("inner"))
        return Atoms(self.root, self.order, self.sizes, tuple(dims)).coalesced()

    def coalesced(self) -> Atoms:
        """Atoms that lie side by side in one dim and in the root's order, as one atom."""
        sizes, dims, order = dict(self.sizes), [], list(self.order)
        for atoms in self.dims:
            kept: list[int] = []
            for atom in atoms:
                if kept and order.index(kept[-1]) + 1 == order.index(atom):
                    sizes[kept[-1]] *= sizes.pop(atom)
                    order.remove(atom)
                else:
                    kept.append(atom)
            dims.append(tuple(kept))
        return Atoms(self.root, tuple(order), tuple((a, sizes[a]) for a in order), tuple(dims))

    def _split(self, dim: int, inner: int) -> Atoms | None:
        """Dim `dim` cut into (size / inner, inner), cutting an atom in two where the cut falls
        inside it (None when the cut does not divide that atom)."""
        state, atoms = self, self.dims[dim]
        cut, tail = len(atoms), 1
        while tail < inner:
            cut -= 1
            size = state.size(atoms[cut])
            if tail * size > inner:  # the cut falls inside this atom: cut the atom too
                if inner % tail or size % (inner // tail):
                    return None
                state = state._refine(atoms[cut], size * tail // inner)
                atoms, cut = state.dims[dim], cut + 1
                break
            tail *= size
        dims = list(state.dims)
        dims[dim:dim + 1] = [atoms[:cut], atoms[cut:]]
        return Atoms(state.root, state.order, state.sizes, tuple(dims))

    def _refine(self, atom: int, outer: int) -> Atoms:
        """`atom` cut into an outer atom of size `outer` and an inner one, everywhere."""
        fresh = max(a for a, _ in self.sizes) + 1
        inner = self.size(atom) // outer
        pieces = (atom, fresh)
        sizes = tuple(s for s in self.sizes if s[0] != atom) + ((atom, outer), (fresh, inner))

        def cut(atoms: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(p for a in atoms for p in (pieces if a == atom else (a,)))

        return Atoms(self.root, cut(self.order), sizes, tuple(cut(d) for d in self.dims))

    def in_order(self) -> bool:
        """Whether the chain keeps every element in the root's order: a reshape, however
        written (a permutation of unit dims, a round trip)."""
        return self.permutation() == sorted(self.permutation())

    def permutation(self) -> list[int]:
        """Where each atom of the result sits in the root's order."""
        return [self.order.index(a) for dim in self.dims for a in dim]


def canonical_movement(graph: Graph) -> Graph:
    """`graph` with every chain of reordering ops that keeps element order (or swaps unit dims
    with others) written in canonical form from its root, where that is shorter than the
    chain; other chains keep their spelling."""
    prefix = "~m"  # fresh node names, also when the graph was canonicalised before
    while any(node.name.startswith(prefix) for node in graph):
        prefix += "~"
    builder = GraphBuilder(prefix=prefix)
    result = builder.graph
    result.outputs = list(graph.outputs)
    alias: dict[str, str] = {}
    states: dict[str, Atoms] = {}
    # Reordering ops from the chain's root as the code wrote them, and whether one swapped a
    # unit dim with another (einsum's way of moving dims).
    steps: dict[str, tuple[int, bool]] = {}
    for node in graph:
        inputs = tuple(alias.get(i, i) for i in node.inputs)
        if node.op not in REORDERING or 0 in node.shape:  # (an empty tensor has no order)
            result.add(Node(node.name, node.op, inputs, node.attrs, node.shape, node.dtype,
                            node.source))
            continue
        state = (states.get(node.inputs[0]) or Atoms.of(result[inputs[0]])).after(node)
        count, unit = steps.get(node.inputs[0], (0, False))
        steps[node.name] = count + 1, unit or _swaps_unit_dim(node)
        if state is not None:
            states[node.name] = state
        if state is not None and (state.in_order() or steps[node.name][1]):
            before = len(result)
            builder.source = node.source
            canonical = _emit(builder, result[state.root], state, node).name
            if len(result) - before < steps[node.name][0]:  # shorter than the code's own chain
                alias[node.name] = canonical
                continue
        moved = result.add(Node(node.name, node.op, inputs, node.attrs, node.shape, node.dtype,
                                node.source))
        if state is None:  # a cut across atoms: the chain restarts here
            states[node.name], steps[node.name] = Atoms.of(moved), (0, False)
    result.outputs = [alias.get(o, o) for o in graph.outputs]
    return result.pruned()


def _swaps_unit_dim(node: Node) -> bool:
    return node.op == "transpose" and 1 in (node.shape[node.attr("dim0")],
                                            node.shape[node.attr("dim1")])


def _emit(builder: GraphBuilder, root: Node, state: Atoms, node: Node) -> Ref:
    """`node`, a chain from `root` in `state`: one reshape, or a reshape into the atoms, one
    permutation and a reshape into `node`'s shape."""
    ref = Ref(root.name, root.shape, root.dtype)
    if not state.in_order():
        ref = builder.reshape(ref, tuple(state.size(a) for a in state.order))
        ref = builder.permute(ref, state.permutation())
    return builder.reshape(ref, node.shape)
