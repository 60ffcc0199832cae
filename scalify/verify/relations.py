"""Relations between a reference tensor and rank tensors: built from placements, and described."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShapeError
from ..placements import Custom, Partial, Placement, Replicate, Shard, Stage
from ..rules.terms import App, Term, leaves, parse

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Relation:
    """`term` (over rank tensors) equals the reference value; each alias `(term, name)` says
    that rank tensor `name` also equals `term` (replicas). `inherited` keeps the inputs' replica
    facts, which later ops need when one rank's copy stands for all."""

    term: str
    aliases: tuple[tuple[str, str], ...] = ()
    inherited: tuple[tuple[str, str], ...] = ()  # replica facts about the inputs' rank tensors
    # Set while no rank tensor holds the value (the ranks compute it fused with later ops, e.g.
    # attention merged over key blocks): the reference op where the run began, and its length.
    # `term` is then the value computed from relations, which a later op must bring back.
    pending: str | None = None
    fused: int = 0

    def facts(self) -> tuple[tuple[str, str], ...]:
        return self.aliases + self.inherited

    def leaf_names(self) -> list[str]:
        names = leaves(parse(self.term))
        for term, name in self.facts():
            names += leaves(parse(term)) + [name]
        return list(dict.fromkeys(names))


def leaf(name: str) -> str:
    return f'(dist "{name}")'


def nest(head: str, terms: list[str]) -> str:
    """A right-nested chain `(head t0 (head t1 ... tn))`: n-ary sums as binary terms."""
    result = terms[-1]
    for term in reversed(terms[:-1]):
        result = f"({head} {term} {result})"
    return result


def concat_terms(terms: list[str], sizes: list[int], dim: int) -> str:
    result, rest = terms[-1], sizes[-1]
    for term, size in zip(reversed(terms[:-1]), reversed(sizes[:-1])):
        result = f"(concat {term} {result} {dim} {size} {rest})"
        rest += size
    return result


def from_placement(target: str, placement: Placement, ref_shape: Shape,
                   rank_names: list[str], rank_shapes: list[Shape]) -> Relation:
    """The relation a placement states between a reference input and the ranks' inputs."""
    world = len(rank_names)
    if isinstance(placement, Replicate):
        _expect_shapes(target, placement, rank_shapes, [ref_shape] * world)
        return Relation(leaf(rank_names[0]), tuple((leaf(rank_names[0]), n) for n in rank_names[1:]))
    if isinstance(placement, Partial):
        _expect_shapes(target, placement, rank_shapes, [ref_shape] * world)
        return Relation(nest("pmax" if placement.op == "max" else "psum",
                             [leaf(name) for name in rank_names]))
    assert isinstance(placement, Shard)
    return _shard_relation(target, placement, ref_shape, rank_names, rank_shapes)


def _shard_relation(target: str, placement: Shard, ref_shape: Shape, rank_names: list[str],
                    rank_shapes: list[Shape]) -> Relation:
    dim = placement.dim % len(ref_shape)
    chunks = placement.chunks(len(rank_names))
    if len(chunks) != len(rank_names) or sorted(set(chunks)) != list(range(max(chunks) + 1)):
        raise ShapeError(f"{target}: {placement} must give every rank a chunk and use chunks 0..k")
    count, blocks = max(chunks) + 1, placement.blocks
    if ref_shape[dim] % (count * blocks):
        raise ShapeError(f"{target}: dim {dim} of size {ref_shape[dim]} does not split into "
                         f"{count * blocks} equal pieces for {placement}")
    piece = ref_shape[dim] // (count * blocks)
    local = tuple(piece * blocks if d == dim else s for d, s in enumerate(ref_shape))
    _expect_shapes(target, placement, rank_shapes, [local] * len(rank_names))
    holder = {chunk: rank_names[chunks.index(chunk)] for chunk in range(count)}
    if blocks == 1:
        terms = [leaf(holder[c]) for c in range(count)]
    else:
        terms = [f"(slice {leaf(holder[c])} {dim} {b * piece} {(b + 1) * piece})"
                 for b in range(blocks) for c in range(count)]
    aliases = tuple((leaf(holder[c]), name) for name, c in zip(rank_names, chunks)
                    if name != holder[c])
    return Relation(concat_terms(terms, [piece] * len(terms), dim), aliases)


def family_relation(target: str, placement: Placement, ref_shape: Shape, name: str,
                    local_shape: Shape, world: int) -> Relation:
    """The relation a placement states for a symbolic program, where leaf `name` stands for
    every rank's input (ir/symmetry.py)."""
    if isinstance(placement, (Replicate, Partial)):
        _expect_shapes(target, placement, [local_shape], [ref_shape])
        if isinstance(placement, Replicate):
            return Relation(leaf(name))
        return Relation(f"({'rmax' if placement.op == 'max' else 'rsum'} {leaf(name)})")
    assert isinstance(placement, Shard)
    dim = placement.dim % len(ref_shape)
    if list(placement.chunks(world)) != list(range(world)) or ref_shape[dim] % (world * placement.blocks):
        raise ShapeError(f"{target}: {placement} is not an even shard over {world} ranks")
    piece = ref_shape[dim] // (world * placement.blocks)
    local = tuple(piece * placement.blocks if d == dim else s for d, s in enumerate(ref_shape))
    _expect_shapes(target, placement, [local_shape], [local])
    if placement.blocks == 1:
        return Relation(f"(rcat {leaf(name)} {dim} {piece})")
    terms = [f"(rcat (slice {leaf(name)} {dim} {b * piece} {(b + 1) * piece}) {dim} {piece})"
             for b in range(placement.blocks)]
    return Relation(concat_terms(terms, [piece * world] * placement.blocks, dim))


def stage_relation(target: str, placement: Stage, ref_shape: Shape, name: str,
                   shape: Shape | None) -> Relation:
    """The relation of a tensor rank `placement.rank` alone holds whole (as `name`, of `shape`;
    None when that rank's program has no such input)."""
    if shape is None:
        raise ShapeError(f"{target}: {placement} says rank {placement.rank} holds it, but its "
                         "program has no input of that name")
    _expect_shapes(target, placement, [shape], [ref_shape])
    return Relation(leaf(name))


def output_holders(placements: list[Placement], position: int, world: int) -> list[tuple[int, int]]:
    """(rank, index among that rank's outputs) of reference output `position`: each rank returns,
    in order, the outputs it holds (all but the other ranks' `Stage` outputs). A symbolic
    program is one rank (world 1) standing for all."""
    def held(placement: Placement, rank: int) -> bool:
        return not isinstance(placement, Stage) or placement.holds(rank)

    return [(rank, sum(held(p, rank) for p in placements[:position]))
            for rank in range(world) if held(placements[position], rank)]


def even_placements(placements: dict[str, Placement], world: int) -> bool:
    """Whether every placement is expressible over a rank family (no repeated chunks or pieces):
    Custom layouts only when each rank holds even blocks in its tensor of the reference's own
    name, as an SPMD program's inputs are (fused tensors of other names keep the per-rank path)."""
    return all(isinstance(p, (Replicate, Partial)) or isinstance(p, Shard)
               and list(p.chunks(world)) == list(range(world))
               or isinstance(p, Custom) and (p.even_blocks(world) or ("",))[0] == target
               for target, p in placements.items())


def _expect_shapes(target: str, placement: Placement, got: list[Shape], want: list[Shape]) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        if tuple(g) != tuple(w):
            raise ShapeError(f"{target}: rank {rank} holds shape {list(g)} but {placement} of the "
                             f"reference shape implies {list(w)}")


def expected_output(placement: Placement, rank_outputs: list[str], rank_shapes: list[Shape],
                    ref_shape: Shape, world: int, symbolic: bool = False) -> list[str]:
    """Terms the reference output must equal for `placement` (one per check: every rank's
    copy of a replicated output); for a symbolic program, `rank_outputs` is its one output
    standing for every rank. Shards (fused blocks included) are stated as inputs are."""
    if symbolic:
        return [family_relation("output", placement, ref_shape, rank_outputs[0], rank_shapes[0],
                                world).term]
    if isinstance(placement, Replicate):
        return [leaf(name) for name in rank_outputs]
    return [from_placement("output", placement, ref_shape, rank_outputs, rank_shapes).term]


def describe(term: Term, name_of: dict[str, str]) -> str:
    """A short human description: a placement when the term is one, else the term itself."""
    if isinstance(term, App):
        names = leaves(term)
        if term.head == "dist":
            return f"the rank tensor {name_of.get(term.args[0], term.args[0])}"
        family = isinstance(term.args[0], App) and term.args[0].head == "dist"
        if term.head == "rcat" and family:
            return f"Shard({term.args[1]}) over all ranks of {describe(term.args[0], name_of)}"
        if term.head in ("rsum", "rmax") and family:
            return (f"Partial({term.head[1:]}) over all ranks of "
                    f"{describe(term.args[0], name_of)}")
        if term.head == "concat" and _chain_of(term, "concat") and len(set(names)) == len(names):
            return f"Shard({term.args[2]}) of {_rank_list(names, name_of)}"
        if term.head == "psum" and _chain_of(term, "psum"):
            return f"Partial(sum) of {_rank_list(names, name_of)}"
        inner = ", ".join(describe(a, name_of) if isinstance(a, App) else repr(a) for a in term.args)
        return f"{term.head}({inner})"
    return repr(term)


def read_in_part(term: Term, shape_of: dict[str, Shape]) -> set[str]:
    """The rank tensors `term` reads only through slices that leave some of a dim unread: the
    rest of such a tensor holds what the reference value does not (two ranks' copies of one
    shard gathered side by side), so it is not a value known equal to the reference's."""
    cuts: dict[str, list[tuple[int, int, int]] | None] = {}
    stack = [term]
    while stack:
        current = stack.pop()
        if not isinstance(current, App):
            continue
        inner = current.args[0] if current.head == "slice" and current.args else None
        if isinstance(inner, App) and inner.head == "dist":
            name, (dim, start, end) = inner.args[0], current.args[1:4]
            if cuts.get(name, []) is not None:
                cuts.setdefault(name, []).append((dim, start, end))
            continue
        if current.head == "dist":
            cuts[current.args[0]] = None  # read whole somewhere
            continue
        stack.extend(current.args)
    return {name for name, read in cuts.items()
            if read is not None and name in shape_of and not _covered(read, shape_of[name])}


def _covered(cuts: list[tuple[int, int, int]], shape: Shape) -> bool:
    """Whether the slices of one dim, taken together, read all of it."""
    for dim in {dim for dim, _, _ in cuts}:
        reach = 0
        for start, end in sorted((s, e) for d, s, e in cuts if d == dim):
            if start > reach:
                return False
            reach = max(reach, end)
        if dim < len(shape) and reach >= shape[dim]:
            return True
    return False


def _chain_of(term: App, head: str) -> bool:
    return all(not isinstance(a, App) or a.head == "dist" or (a.head == head and _chain_of(a, head))
               for a in term.args)


def _rank_list(names: list[str], name_of: dict[str, str]) -> str:
    described = [name_of.get(n, n) for n in names]
    return "[" + ", ".join(described[:3]) + (", ..." if len(described) > 3 else "") + "]"
