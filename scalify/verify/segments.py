"""Layer memoization: a canonical key for one layer's verification problem.

A segment is the reference ops of one numbered layer (`model.layers.3`) with the distributed
ops of that layer on every rank. Its key spells out, with rank tensors renamed in order of first
appearance, everything the layer's windows read: the reference ops, the distributed ops, the
relations flowing in from outside, and the shapes of outside rank tensors. Equal keys mean
isomorphic windows, so the stored relations (renamed back) are exactly what re-running would
give; names and layer indices are erased.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ..ir.graph import Graph, Node
from .relations import Relation

_LEAF = re.compile(r'\(dist "([^"]+)"\)')
Canonical = tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] | None


@dataclass
class SegmentKey:
    digest: str
    dist_names: list[str]  # canonical index -> rank tensor name

    def to_canonical(self, relation: Relation | None) -> Canonical:
        if relation is None:
            return None
        index = {name: i for i, name in enumerate(self.dist_names)}

        def rename(text: str) -> str:
            return _LEAF.sub(lambda m: f'(dist "v{index[m.group(1)]}")', text)

        def facts(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
            return tuple((rename(t), f"v{index[n]}") for t, n in pairs)

        return rename(relation.term), facts(relation.aliases), facts(relation.inherited)

    def from_canonical(self, stored: Canonical) -> Relation | None:
        if stored is None:
            return None
        term, aliases, inherited = stored

        def rename(text: str) -> str:
            return _LEAF.sub(lambda m: f'(dist "{self.dist_names[int(m.group(1)[1:])]}")', text)

        def facts(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
            return tuple((rename(t), self.dist_names[int(n[1:])]) for t, n in pairs)

        return Relation(rename(term), facts(aliases), facts(inherited))


def segment_key(nodes: list[Node], region_dist: list[Node], relations: dict[str, Relation | None],
                dist: Graph, ref_const: dict[str, str], dist_const: dict[str, str]) -> SegmentKey | None:
    """The canonical key of a layer, or None when an incoming relation is missing."""
    names: dict[str, int] = {}

    def canonical(text: str) -> str:
        return _LEAF.sub(lambda m: f'(dist "v{names.setdefault(m.group(1), len(names))}")', text)

    def leaf_id(name: str) -> str:
        return f"v{names.setdefault(name, len(names))}"

    position = {node.name: i for i, node in enumerate(nodes)}
    boundary = list(dict.fromkeys(i for node in nodes for i in node.inputs if i not in position))
    lines = []
    for j, name in enumerate(boundary):
        relation = relations[name]
        if relation is None:
            return None
        facts = ";".join(f"{canonical(t)}~{leaf_id(n)}" for t, n in relation.facts())
        lines.append(f"B{j}={canonical(relation.term)}|{facts}")
    for i, node in enumerate(nodes):
        args = [f"R{position[a]}" if a in position else f"B{boundary.index(a)}" for a in node.inputs]
        lines.append(f"R{i}={node.op}{node.attrs}{node.shape}{node.dtype}{args}"
                     f"{ref_const.get(node.name, '')}")
    for node in region_dist:
        args = [f"c{dist_const[a]}" if a in dist_const else leaf_id(a) for a in node.inputs]
        lines.append(f"{leaf_id(node.name)}={node.op}{node.attrs}{node.shape}{node.dtype}{args}")
    inside = {node.name for node in region_dist}
    lines += [f"{leaf_id(n)}:{dist[n].shape}" for n in list(names) if n not in inside]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return SegmentKey(digest, list(names))
