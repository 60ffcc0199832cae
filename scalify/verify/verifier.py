"""Relation inference: walk the reference graph and, per op, find its relation to the rank tensors.

For each reference op a small egglog window holds the op applied to its inputs' relations and
the nearby distributed ops (same layer, a few hops downstream of the inputs' rank tensors);
saturation plus extraction gives a term over rank tensors, which is carried forward. An op with
no such term is a discrepancy; at the end each output must equal its expected relation.
"""
from __future__ import annotations

import functools
import re
import time
from collections import deque
from dataclasses import dataclass, field, replace
from fractions import Fraction
from math import prod
from functools import cached_property
from typing import Callable

import torch

from ..errors import ShapeError
from ..ir.distributed import COLLECTIVES, DistributedGraph, constant_terms, constant_values
from ..ir.graph import Graph, Node, SourceLoc
from ..ir.ops import MATMUL, MOVEMENT, OPS, RANDOM
from ..ir.scaling import scalar_factor
from ..placements import Custom, Placement, Replicate, Stage
from ..report.model import Discrepancy
from ..rules.families import LINEAR_UNARY_OPS, WINDOW_TRAITS
from ..rules.terms import (App, Term, is_relational, leaves, op_key, parse, reads_dim_counts,
                           render, reshape_count, shape_facts)
from .constants import ConstantOrigins
from .congruence import broadcast_term, rank_concat_relation, replicated_twins
from .elements import (HeldPiece, Origins, Products, follow_elements, numbered_definition,
                       replicas_of)
from .polynomials import Polynomials
from .custom import custom_output_terms, custom_relation, family_custom_relation, rank_name
from .encode import encode
from .opaque import opaque_dependents, opaque_sources, unknown_reason
from .relations import (Relation, Shape, describe, expected_output, family_relation,
                        from_placement, leaf, output_holders, read_in_part, stage_relation)
from .regions import matched_regions, region_of
from .segments import SegmentKey, segment_key
from .session import EgglogSession, NoAnswer, WindowLimits
from .store import MemoStore, ProofStore
from .upstream import chain_lines, cut_lines

WHOLE_PROGRAM_ELEMENTS = 1 << 16  # rank programs this small are searched whole by numbering
NUMBERING_TERMS = 1 << 22  # polynomial terms, and element ids, kept between queries
# Ops that only move data (a gather too): a window's depth does not count them, so a relation
# carried as movement of rank tensors (a reshape, a slice) still reaches the ranks' next op.
_MOVES_DATA = frozenset(name for name, op in OPS.items() if op.trait == MOVEMENT) | {
    "all_gather", "all_to_all"}
_LEAF_NAME = re.compile(r'\(dist "([^"]+)"\)')


_BROADCASTS = frozenset({"expand", "unsqueeze"})
_UNDEFINED = frozenset({"opaque", "placeholder"})  # rank tensors windows never define


@dataclass
class VerifyOptions:
    window_depth: int = 4
    max_window_nodes: int = 512
    backward_depth: int = 3
    iterations: int = 12  # plus 4 per rank: nested concats unfold one level per iteration
    # Reference ops in a row the ranks may compute without holding them (a vocab-parallel
    # loss's backward: the reference's negated softmax, which ranks add to their own pick).
    fused_ops: int = 3
    context_parallel: bool = False  # ranks hold sequence chunks (rules/context.py)
    memo: bool = True  # prove identical windows once
    memo_store: str | None = None  # SQLite file shared by runs
    rank_symmetry: bool = True  # verify one symbolic program for all ranks when they allow it
    limits: WindowLimits = WindowLimits()  # past them a window's answer is unknown
    # Try a one-hop window first for every op, not only for ops on replicated inputs (programs
    # whose ranks keep the reference's op structure, e.g. one compiler's SPMD HLO).
    narrow_first: bool = False
    # Take a rank node applying the same op to the inputs' rank tensors without a window
    # (verify/congruence.py; symbolic programs only).
    congruence: bool = False
    # A wall-clock time (`time.time()`) past which the ops not yet proved are left unknown,
    # so a run within a CI budget still reports what it found.
    deadline: float | None = None


@dataclass
class Verification:
    """What proving found: discrepancies, counts, and each reference op's relation (for a
    whole run, or one segment)."""

    discrepancies: list[Discrepancy] = field(default_factory=list)
    windows: int = 0
    blocked: int = 0
    memo_hits: int = 0
    memo_misses: int = 0
    layer_hits: int = 0
    rule_matches: int = 0
    largest_egraph: int = 0
    relations: dict[str, Relation | None] = field(default_factory=dict)
    # The discrepancy to report for each open run of fused ops, by the op that began it.
    deferred: dict[str, Discrepancy] = field(default_factory=dict)
    # A run's branch reported at its own op (another branch was brought back): the op that
    # began the run, by the reported op.
    run_origins: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # ops whose window hit its limits, and why
    # Those ops as discrepancies: where the proof stopped, reported as one only when the
    # numbers show that the ranks do not compute the reference.
    suspects: list[Discrepancy] = field(default_factory=list)
    unchecked: int = 0  # ops left unproved because the deadline passed
    # A window read rank ops of other regions (a fused run's): the segment's relations hold
    # for its neighbours as they are, so they are not reused for another layer.
    reached_out: bool = False

    def absorb(self, outcome: Verification) -> None:
        """Add one segment's findings and counts (its relations are merged by the caller)."""
        self.discrepancies += outcome.discrepancies
        self.run_origins.update(outcome.run_origins)
        self.unknown += outcome.unknown
        self.suspects += outcome.suspects
        self.windows += outcome.windows
        self.blocked += outcome.blocked
        self.unchecked += outcome.unchecked
        self.memo_hits += outcome.memo_hits
        self.memo_misses += outcome.memo_misses
        self.rule_matches += outcome.rule_matches
        self.largest_egraph = max(self.largest_egraph, outcome.largest_egraph)


SegmentRunner = Callable[[int, dict[str, Relation | None]], Verification]


class Verifier:
    """Infers relations for one reference graph against one distributed graph."""

    def __init__(self, ref: Graph, dist: DistributedGraph, options: VerifyOptions,
                 session: EgglogSession | None = None, store: MemoStore | None = None) -> None:
        """`store` (default: a ProofStore at `options.memo_store`) holds proofs across runs."""
        self.ref, self.dist, self.options = ref, dist, options
        if store is None and options.memo_store and options.memo:
            store = ProofStore(options.memo_store)
        self.store = store if options.memo else None
        unfold = 0 if dist.symbolic else 4 * dist.world_size
        self.session = session or EgglogSession(
            options.iterations + unfold, options.memo, self.store, rank_families=dist.symbolic,
            context_parallel=options.context_parallel, limits=options.limits)
        self.users = dist.graph.users()
        dist_values, ref_values = constant_values(dist.graph), constant_values(ref)
        self.dist_const = constant_terms(dist.graph, dist_values)
        self.const_nodes: dict[str, set[str]] = {}  # the rank nodes of each constant term
        for name, term in self.dist_const.items():
            self.const_nodes.setdefault(term, set()).add(name)
        self.ref_const = constant_terms(ref, ref_values)
        self.ref_const_terms = set(self.ref_const.values())
        self.constants = ConstantOrigins()
        self.constants.add(dist.graph, self.dist_const, dist_values)
        self.constants.add(ref, self.ref_const, ref_values)
        self._numbering: dict[Products, tuple[tuple, Origins]] = {}  # (its replicas, numbering)
        self._polynomials = Polynomials()
        self.dist_opaque = opaque_dependents(dist.graph)  # rank values nothing is known about
        rank_regions = {n.name: region_of(n.source.module) for n in dist.graph}
        as_reference = matched_regions((region_of(n.source.module) for n in ref),
                                       rank_regions.values())
        self.region = {name: as_reference[region] for name, region in rank_regions.items()}
        self.labels = {n.name: _label(n, "every rank" if dist.symbolic else
                                      f"rank {dist.rank_of(n.name)}") for n in dist.graph}
        self.region_nodes: dict[str, list[Node]] = {}
        for name in sorted(self.region, key=dist.order.get):
            if name not in self.dist_const and dist.graph[name].op != "placeholder":
                self.region_nodes.setdefault(self.region[name], []).append(dist.graph[name])
        self.segment_memo: dict[str, list] = {}
        self.ref_users = ref.users()
        self.placements: dict[str, Placement] = {}

    # Entry point.

    def run(self, placements: dict[str, Placement], output_placements: list[Placement],
            progress: Callable[[int, int], None] = lambda done, total: None,
            verify_segment: SegmentRunner | None = None) -> Verification:
        """Verify segment by segment; `verify_segment` (default: this verifier's own) lets an
        executor prove missed segments elsewhere, e.g. on Ray actors."""
        result = Verification()
        relations = result.relations
        self.placements = placements
        run_segment = verify_segment or self.verify_segment
        total, done = len(self.ref.nodes), 0
        for index, (region, nodes) in enumerate(self.segments):
            key = self._segment_key(region, nodes, relations)
            stored = self._stored_segment(key) if key else None
            if stored is not None:
                for node, relation in zip(nodes, stored):
                    relations[node.name] = key.from_canonical(relation)
                result.layer_hits += 1
            else:
                outcome = run_segment(index, self.boundary(index, relations))
                relations.update(outcome.relations)
                result.absorb(outcome)
                if key and not (outcome.discrepancies or outcome.unknown or outcome.reached_out):
                    self._remember_segment(key, [relations[n.name] for n in nodes])
                if self.store is not None:
                    self.store.commit()  # a job that dies keeps every finished segment
            done += len(nodes)
            progress(done, total)
        self._check_outputs(output_placements, relations, result)
        return result

    def boundary(self, index: int, relations: dict[str, Relation | None]) -> dict[str, Relation | None]:
        """The relations segment `index` reads from outside itself."""
        nodes = self.segments[index][1]
        inside = {node.name for node in nodes}
        return {name: relations[name] for node in nodes for name in node.inputs
                if name not in inside}

    def verify_segment(self, index: int, incoming: dict[str, Relation | None]) -> Verification:
        """Infer the relations of one segment's reference ops from the relations flowing in;
        the result holds only the segment's own relations."""
        partial = Verification(relations=dict(incoming))
        session = self.session
        hits, misses, matches = session.hits, session.misses, session.rule_matches
        session.largest_egraph = 0
        region, nodes = self.segments[index]
        for node in nodes:
            self._visit(node, partial.relations, partial)
        self._close_fused_runs(nodes, partial)
        if partial.unchecked:
            partial.unknown.append(f"{partial.unchecked} ops in {region or 'the top level'}: not "
                                   "proved, the run's deadline passed first")
            partial.suspects += [  # runs still open: where the proof parted from the ranks
                replace(found, hint=f"{found.hint}; the run's deadline passed before a later op "
                                    "brought this value back to the ranks")
                for found in partial.deferred.values()]
        partial.relations = {node.name: partial.relations[node.name] for node in nodes}
        partial.memo_hits, partial.memo_misses = session.hits - hits, session.misses - misses
        partial.rule_matches = session.rule_matches - matches
        partial.largest_egraph = session.largest_egraph
        return partial

    def _close_fused_runs(self, nodes: list[Node], result: Verification) -> None:
        """A value still pending where its run ends (no user in this segment, or an output)
        was never brought back to the ranks: report the op that began its run."""
        inside = {node.name for node in nodes}
        for node in nodes:
            relation = result.relations[node.name]
            if relation is None or relation.pending is None:
                continue
            users = self.ref_users[node.name]
            if not users or node.name in self.ref.outputs or not set(users) <= inside:
                self._fail_run(relation.pending, node, result)
                result.relations[node.name] = None

    def _fail_run(self, origin: str, node: Node, result: Verification,
                  ending: Discrepancy | None = None) -> None:
        """Report the run begun at `origin` (where the ranks and the reference part ways), with
        the rank ops of the window that last looked for it (`ending`, at `node`: where the
        ranks compute what the run does), or, when another branch of it was brought back,
        `node` itself."""
        found = result.deferred.pop(origin, None)
        if found is not None and ending is not None:
            found = replace(
                found, path=found.path + [loc for loc in [ending.dist_source, *ending.path]
                                          if loc.file and loc not in found.path],
                nearby=found.nearby + [loc for loc in ending.nearby if loc not in found.nearby])
        if found is None:
            relation = result.relations.get(node.name)
            found = Discrepancy(
                node.op, node.name, node.source.module, node.source, SourceLoc(),
                found=describe(parse(relation.term), self.labels) if relation else "",
                expected="a relation to the ranks' tensors (Replicate, Shard or Partial)",
                hint="no rank tensor holds this value, and no later op brings it back")
            result.run_origins[node.name] = origin
        result.discrepancies.append(found)

    # Inputs.

    def _visit(self, node: Node, relations: dict[str, Relation | None],
               result: Verification) -> None:
        if node.op == "placeholder":
            relations[node.name] = self._input_relation(node, self.placements)
        elif node.op == "opaque" or OPS[node.op].trait == RANDOM:
            relations[node.name] = None
            result.unknown.append(unknown_reason(self.ref, node))
        elif node.name in self.ref_const:
            relations[node.name] = Relation(self.ref_const[node.name])
        elif any(relations[i] is None for i in node.inputs):
            relations[node.name] = None
            result.blocked += 1
        elif self._past_deadline():
            relations[node.name] = None
            result.unchecked += 1
        else:
            relations[node.name] = self._infer(node, relations, result)

    def _past_deadline(self) -> bool:
        return self.options.deadline is not None and time.time() > self.options.deadline

    @cached_property
    def segments(self) -> list[tuple[str, list[Node]]]:
        """Runs of consecutive reference ops in one region (placeholders count as outside every
        layer)."""
        runs: list[tuple[str, list[Node]]] = []
        for node in self.ref:
            region = "" if node.op == "placeholder" else region_of(node.source.module)
            if runs and runs[-1][0] == region:
                runs[-1][1].append(node)
            else:
                runs.append((region, [node]))
        return runs

    def _remember_segment(self, key: SegmentKey, found: list[Relation | None]) -> None:
        try:
            canonical = [key.to_canonical(relation) for relation in found]
        except KeyError:  # a relation names a rank tensor the key does not cover: do not reuse
            return
        self.segment_memo[key.digest] = canonical
        if self.store is not None:
            self.store.put(f"layer:{self.session.stored_kind}", key.digest, canonical)

    def _stored_segment(self, key: SegmentKey) -> list | None:
        stored = self.segment_memo.get(key.digest)
        if stored is None and self.store is not None:
            stored = self.store.get(f"layer:{self.session.stored_kind}", key.digest)
        return stored

    def _segment_key(self, region: str, nodes: list[Node],
                     relations: dict[str, Relation | None]) -> SegmentKey | None:
        if not region or not self.options.memo:
            return None
        return segment_key(nodes, self.region_nodes.get(region, []), relations, self.dist.graph,
                           self.ref_const, self.dist_const)

    def _input_relation(self, node: Node, placements: dict[str, Placement]) -> Relation:
        target = node.attr("target")
        placement = placements.get(target, Replicate())
        if isinstance(placement, Custom) and self.dist.symbolic:  # even blocks (relations.py)
            local = f"r0/{placement.pieces[0].local}"
            return family_custom_relation(placement, node.shape, local,
                                          self.dist.graph[local].shape, self.dist.world_size)
        if isinstance(placement, Custom):
            return custom_relation(target, placement, node.shape, lambda name: (
                self.dist.graph[name].shape if name in self.dist.graph else None))
        if isinstance(placement, Stage):  # never symbolic: even_placements rules it out
            name = f"r{placement.rank}/{target}"
            shape = self.dist.graph[name].shape if name in self.dist.graph else None
            return stage_relation(target, placement, node.shape, name, shape)
        if self.dist.symbolic:
            name = f"r0/{target}"
            if name not in self.dist.graph:
                raise ShapeError(f"{target}: the ranks' programs have no input of that name")
            return family_relation(target, placement, node.shape, name,
                                   self.dist.graph[name].shape, self.dist.world_size)
        names = []
        for rank in range(self.dist.world_size):
            name = f"r{rank}/{target}"
            if name not in self.dist.graph:
                raise ShapeError(f"{target}: rank {rank}'s program has no input of that name")
            names.append(name)
        shapes = [self.dist.graph[n].shape for n in names]
        return from_placement(target, placement, node.shape, names, shapes)

    # One reference op.

    def _infer(self, node: Node, relations: dict[str, Relation | None],
               result: Verification) -> Relation | None:
        inputs = [relations[i] for i in node.inputs]
        congruent = (self._congruent(node, inputs)
                     if self.dist.symbolic and self.options.congruence else None)
        if congruent is not None:
            return congruent
        replicated = all(parse(r.term).head in ("dist", "const") for r in inputs)
        narrow = replicated or self.options.narrow_first
        deeper = 2 * self.options.window_depth
        depths = [1, self.options.window_depth] if narrow else [self.options.window_depth]
        runs = [r for r in inputs if r.pending is not None]
        if runs and node.op in _BROADCASTS:  # a broadcast of a value no rank holds (one op of
            shapes = [self.ref[i].shape for i in node.inputs]  # the run with its value): the
            return Relation(encode(node, [r.term for r in inputs], shapes),  # run's next op
                            pending=runs[0].pending, fused=max(r.fused for r in runs))  # relates it
        if runs:  # the ranks' fused computation ends further downstream
            depths = [deeper]
            result.reached_out = True
        # Last, a window that looks through data movement (the ranks' reshapes and gathers
        # cost no depth): it finds relations carried by movement, at a cost most ops need not pay.
        windows = [(depth, False) for depth in depths] + [(max(depths), True)]
        if runs and not self.options.context_parallel:  # one deep window; a symmetric program
            windows = windows[:1 + self.dist.symbolic]  # (one to prove) then looks through
        narrowest: list[str] | None = None  # the nodes closest to the op, for diagnostics
        searched: set[str] = set()  # every window's rank nodes
        related = None  # the last window that related the op
        for depth, look_through in windows:  # ops on replicated inputs usually match one hop away
            if look_through and related is not None:
                break
            program, window = self._program(node, inputs, depth, look_through, relations,
                                            across=bool(runs))
            narrowest = window if narrowest is None else narrowest
            searched.update(window)
            if look_through and not self.dist.symbolic:  # what movement carries, numbered by
                followed = self._follow(node, inputs, searched, relations)  # its elements
                if followed is not None:  # costs less than saturating the widest window
                    return self._brought_back(followed, runs, result)
            result.windows += 1
            try:
                outcome = self.session.saturate(program)
            except NoAnswer as limit:  # a bound or a shape conflict: neither related nor refuted
                if related is not None or look_through:
                    break  # the narrower window's relation, or its failure, stands
                followed = self._follow(node, inputs, searched, relations)
                if followed is not None:
                    return self._brought_back(followed, runs, result)
                if runs:  # the run's budget is spent here, as past its last op: its first op
                    self._fail_run(runs[0].pending, node, result)  # is reported
                    return None
                result.unknown.append(f"{node.op} at {node.source}: its window gave no answer, {limit}")
                result.suspects.append(replace(self._discrepancy(
                    node, inputs, App(node.op, tuple(parse(r.term) for r in inputs)),
                    narrowest or window, relations), hint=f"its window gave no answer, {limit}"))
                return None
            term = parse(outcome.term)
            if is_relational(term):
                if related is None or reshape_count(term) < reshape_count(parse(related.term)):
                    related = outcome
                ahead = OPS[node.op].trait == MOVEMENT and reshape_count(term) > 0
                if not (depth < deeper and (ahead or replicated and self._fewer_replicas(
                        outcome.same, inputs))):
                    break
                # Some rank's copy lies further downstream, or the ranks may hold this
                # reshape themselves past the window (not only the reshape of what they hold).
                if (deeper, look_through) not in windows:
                    windows.insert(windows.index((depth, look_through)) + 1, (deeper, look_through))
        if related is not None:
            outcome, term = related, parse(related.term)
            copy = self._copy_past_movement(node, inputs, term, relations)
            if copy is not None:
                return self._brought_back(copy, runs, result)
            same = sorted(outcome.same, key=self.dist.order.get)
            chosen = leaf(same[0]) if term.head == "dist" and same else outcome.term  # lowest rank
            aliases = tuple((chosen, name) for name in same if leaf(name) != chosen)
            aliases += tuple((leaf(a), b) for a, b in outcome.leaf_aliases)
            return self._brought_back(
                Relation(chosen, aliases, _inherited(inputs, set(leaves(parse(chosen))))), runs,
                result)
        followed = self._follow(node, inputs, searched, relations)
        if followed is not None:
            return self._brought_back(followed, runs, result)
        # (data movement adds no op to the run: the ranks may hold the values it gathers)
        fused = max((r.fused for r in runs), default=0) + (OPS[node.op].trait != MOVEMENT)
        opaque = self.dist_opaque.intersection(narrowest or window)
        allowed = self.options.fused_ops
        if allowed and fused <= allowed and not opaque:  # perhaps the ranks compute it fused
            if not runs:                                 # with the next ops
                result.deferred[node.name] = self._discrepancy(node, inputs, term,
                                                               narrowest or window, relations)
            return Relation(outcome.term, pending=runs[0].pending if runs else node.name,
                            fused=fused)
        if opaque:
            result.unknown.append(f"{node.op} at {node.source}: the ranks compute it from ops "
                                  "with no lowering to the core IR "
                                  f"({opaque_sources(self.dist.graph, opaque)})")
        elif runs:
            self._fail_run(runs[0].pending, node, result, self._discrepancy(
                node, inputs, term, narrowest or window, relations))
        else:
            result.discrepancies.append(self._discrepancy(node, inputs, term, narrowest or window,
                                                          relations))
        return None

    @staticmethod
    def _brought_back(relation: Relation, runs: list[Relation], result: Verification
                      ) -> Relation:
        """`relation`, found for an op that ends the runs: their deferred reports are void."""
        for run in runs:
            result.deferred.pop(run.pending, None)
        return relation

    def _copy_past_movement(self, node: Node, inputs: list[Relation], term: Term,
                            relations: dict[str, Relation | None]) -> Relation | None:
        """For a movement op whose relation still reshapes what the ranks hold: the ranks' copy
        of its value past their own movement and exchanges (their layout after an all_to_all),
        found by its elements, when it reshapes less. Later ops that read it (a weight gradient
        contracting the tokens) then find the ranks' op without moving the value back."""
        if self.dist.symbolic or OPS[node.op].trait != MOVEMENT or not reshape_count(term):
            return None  # (a symmetric program's elements are not numbered)
        leaves_in = {name for r in inputs for name in r.leaf_names()}
        moved = self._moved_to(leaves_in, region_of(node.source.module))
        copy = self._follow(node, inputs, moved, relations, latest=True, anywhere=False)
        return copy if copy and reshape_count(parse(copy.term)) < reshape_count(term) else None

    def _follow(self, node: Node, inputs: list[Relation], searched: set[str],
                relations: dict[str, Relation | None], latest: bool = False,
                anywhere: bool = True) -> Relation | None:
        """The relation to the windows' rank tensors that hold the elements `node` computes,
        numbered by how they were computed (elements.py); replicas any relation names count as
        the tensors they copy; `latest`: of tensors holding as many elements, the last computed;
        `anywhere`: failing those, any tensor of a program small enough to search whole. A
        contraction the ranks may split and sum is numbered by its products at last."""
        if self.dist.symbolic:
            return None
        value = encode(node, [r.term for r in inputs], [self.ref[i].shape for i in node.inputs])
        origins = self._origins(relations)
        candidates = [self.dist.graph[name] for name in searched]
        term = follow_elements(value, candidates, origins, self.dist.order, latest)
        if term is None and anywhere and self._whole_program_numbered:  # computed elsewhere
            term = follow_elements(value, list(self.dist.graph), origins, self.dist.order)
        if term is None and origins.products == "opaque" and _sums_split_contraction(
                node, candidates):
            term = follow_elements(value, candidates, self._origins(relations, "unexpanded"),
                                   self.dist.order, latest)
        if term is None:
            return None
        return Relation(term, (), _inherited(inputs, set(leaves(parse(term)))))

    @cached_property
    def _whole_program_numbered(self) -> bool:
        """Whether the ranks' programs are small enough to search whole for a value's elements
        (a value recomputed on another path than the one the windows follow: a backward that
        recomputes a partial sum instead of reading the forward's)."""
        return sum(prod(node.shape) for node in self.dist.graph) <= WHOLE_PROGRAM_ELEMENTS

    def _origins(self, relations: dict[str, Relation | None], products: Products | None = None
                 ) -> Origins:
        """Element numbering of rank tensors, copies the relations name counted as their
        sources; kept while no relation names a new copy. Matmuls are numbered as `products`
        says, by default by their products when the ranks' programs are small, else opaquely
        (and "unexpanded" numbers all but the value's own contractions by the opaque numbering)."""
        if products is None:
            products = "expanded" if self._whole_program_numbered else "opaque"
        if self._polynomials.stored > NUMBERING_TERMS:  # start a new table (its ids stay exact)
            self._polynomials, self._numbering = Polynomials(), {}
        below = self._origins(relations, "opaque") if products == "unexpanded" else None
        replicas = replicas_of([r for r in relations.values() if r is not None])
        key = tuple(sorted(replicas.items()))
        kept = self._numbering.get(products)
        if (kept is None or kept[0] != key or kept[1].held > NUMBERING_TERMS
                or kept[1].below is not below):
            kept = self._numbering[products] = key, Origins(
                lambda name: numbered_definition(self._definition(name),
                                                 OPS[self.dist.graph[name].op].trait != RANDOM),
                lambda name: self.dist.graph[name].shape, self.constants.shapes.get,
                replicas, self._held_pieces, self.constants.values.get, self._polynomials,
                products, below)
        return kept[1].new_query()

    @cached_property
    def _held_pieces(self) -> dict[str, list[HeldPiece]]:
        """The reference pieces each rank input laid out by a Custom placement holds."""
        held: dict[str, list[HeldPiece]] = {}
        for target, placement in self.placements.items():
            if not isinstance(placement, Custom) or target not in self.ref:
                continue
            shape = self.ref[target].shape
            for piece in placement.pieces:
                held.setdefault(rank_name(piece), []).append(HeldPiece(
                    target, shape, placement.dim % len(shape), piece.local_start,
                    piece.ref_start, piece.size))
        return held

    def _congruent(self, node: Node, inputs: list[Relation]) -> Relation | None:
        """The relation a rank node applying the same op gives, without a window (congruence.py)."""
        twins = replicated_twins(node, inputs, self.dist.graph, self.users, self.const_nodes,
                                 self.dist.order)
        if twins:
            return Relation(leaf(twins[0]), tuple((leaf(twins[0]), twin) for twin in twins[1:]),
                            _inherited(inputs, set(twins)))
        if any(r.pending is not None for r in inputs):
            return None
        terms, replicas = [r.term for r in inputs], {}
        for term, name in (fact for r in inputs for fact in r.facts()):
            match = _LEAF_NAME.fullmatch(term)
            if match:
                replicas.setdefault(match.group(1), set()).add(name)
        term = (rank_concat_relation(node, terms, self.dist.graph, self.users, self.dist.order,
                                     replicas, self.const_nodes) or broadcast_term(node, terms))
        if term is None:
            return None
        return Relation(term, (), _inherited(inputs, set(leaves(parse(term)))))

    def _program(self, node: Node, inputs: list[Relation], depth: int, look_through: bool,
                 relations: dict[str, Relation | None], across: bool = False
                 ) -> tuple[str, list[str]]:
        """The window program of `node`; `across`: its window may reach rank ops of other
        regions (an op that continues a fused run: the ranks may finish its computation where
        autograd put it elsewhere, e.g. a residual's gradients summed at the embedding)."""
        leaves_in = {name for r in inputs for name in r.leaf_names()}
        region = region_of(node.source.module)
        window = self._window(leaves_in, None if across else region, depth, look_through)
        defined = self._with_dependencies(window, leaves_in,
                                          sorted(leaves_in, key=self.dist.order.get), region)
        ref_args = [r.term for r in inputs]
        shapes = [self.ref[i].shape for i in node.inputs]
        lines = [f"(let $y {encode(node, ref_args, shapes)})"]
        lines += [f"(union {term} {leaf(name)})" for r in inputs for term, name in r.facts()]
        if self.dist.symbolic:  # each relation equals the reference value on every rank
            lines += [f"(inv {term})" for r in inputs for term in _relational_parts(r.term)]
            lines.append(f"(set (world) {self.dist.world_size})")
            # so does every rank tensor in the window or the inputs' relations that holds a
            # whole reference value (a replicated input the ranks stack with this op's input
            # and broadcast; a replicated weight an input reads a slice of, which ranks cut too)
            replicated = {_bare_leaf(r.term) for r in relations.values() if r is not None}
            mentioned = dict.fromkeys([*(a for d in defined for a in [d, *self.dist.graph[d].inputs]),
                                       *leaves_in])
            lines += [f"(inv {leaf(name)})" for name in mentioned if name in replicated]
        lines += self._definitions(defined)
        nodes = [node, *(self.dist.graph[d] for d in defined)]
        for trait, ops in WINDOW_TRAITS.items():
            keys = {op_key(n.op, dict(n.attrs)) for n in nodes if n.op in ops}
            lines += [f"({trait} {render(key)})" for key in sorted(keys)]
        lines += self._share_facts(nodes)
        lines += self._sizes(lines)
        return "\n".join(lines), window

    def _share_facts(self, nodes: list[Node]) -> list[str]:
        """The scalings by 1/2 (`halves`), in a symmetric program by 1/world (`world_share`),
        and by a positive factor (`positive_scale`) among the window's ops."""
        shares = {"halves": 2, **({"world_share": self.dist.world_size} if self.dist.symbolic
                                  else {})}
        facts = set()
        for n in nodes:
            factor, key = scalar_factor(n), render(op_key(n.op, dict(n.attrs)))
            facts.update(f"({trait} {key})" for trait, parts in shares.items()
                         if factor == Fraction(1, parts))
            if n.op in ("mul_scalar", "div_scalar") and isinstance(n.attr("value"), (int, float)) \
                    and n.attr("value") > 0:
                facts.add(f"(positive_scale {key})")
        return sorted(facts)

    def _fewer_replicas(self, same: tuple[str, ...], inputs: list[Relation]) -> bool:
        """Whether fewer ranks hold the op's value than hold copies of each of its replicated
        inputs (on the per-rank path, some rank's copy is further than the window reached)."""
        holders = None
        for relation in inputs:
            if parse(relation.term).head != "dist":
                continue
            names = leaves(parse(relation.term)) + [n for t, n in relation.aliases
                                                    if t == relation.term]
            ranks = {self.dist.rank_of(n) for n in names}
            holders = ranks if holders is None else holders & ranks
        return holders is not None and len({self.dist.rank_of(n) for n in same}) < len(holders)

    def _window(self, start: set[str], region: str | None, max_depth: int,
                look_through: bool) -> list[str]:
        """Distributed nodes of `region` (of any, if None) within `max_depth` hops downstream
        of `start`, where ops that move data are no hop if `look_through`.

        Ops on replicated inputs have their counterparts one hop away on every rank; ops on
        sharded or partial inputs look further, past collectives. Looking through, data movement
        of another region is crossed too (a layer's input transposed where it was made).
        """
        seeds = self._moved_from(start, region) if look_through else set(start)
        depth = {name: 0 for name in seeds}
        queue = deque(sorted(seeds, key=self.dist.order.get))
        while queue:
            name = queue.popleft()
            if depth[name] >= max_depth:
                continue
            for user in self.users[name]:
                moves = look_through and self.dist.graph[user].op in _MOVES_DATA
                if user in depth or user in self.dist_const or region is not None and (
                        self.region[user] != region and not moves):
                    continue
                depth[user] = depth[name] + (not moves)
                (queue.appendleft if moves else queue.append)(user)
        window = sorted((n for n in depth if n not in start), key=self.dist.order.get)
        return window[:self.options.max_window_nodes]

    def _moved_to(self, start: set[str], region: str | None) -> set[str]:
        """The tensors of `region` that `start`'s members are moved or exchanged into, by data
        movement only (their elements are `start`'s: numbering them costs no arithmetic)."""
        found, stack = set(), list(start)
        while stack:
            for user in self.users[stack.pop()]:
                if (user not in found and self.dist.graph[user].op in _MOVES_DATA
                        and self.region[user] == region):
                    found.add(user)
                    stack.append(user)
        return found

    def _moved_from(self, start: set[str], region: str | None) -> set[str]:
        """`start` and the tensors its members were moved from (a rank's merge of rows whose
        unmerged rows other ops read: a bias gradient summed over each dim in turn)."""
        found, stack = set(start), list(start)
        while stack:
            node = self.dist.graph[stack.pop()]
            if node.op not in _MOVES_DATA:
                continue
            for arg in node.inputs:
                if (arg not in found and arg not in self.dist_const
                        and region in (None, self.region[arg])):
                    found.add(arg)
                    stack.append(arg)
        return found

    def _with_dependencies(self, window: list[str], known: set[str], leaves_in: list[str],
                           region: str) -> list[str]:
        """The window plus the definitions of its other arguments and of the input rank
        tensors, a few hops upstream, within `region` (so identical layers give identical
        windows). An all_to_all's inputs are always defined: its value is blocks of every
        member's input, which say nothing until defined (e.g. the copies of a gradient that
        the backward of a combine sends back)."""
        frontier = window + [n for n in leaves_in if n not in self.dist_const
                             and self.dist.graph[n].op != "placeholder" and self.region[n] == region]
        defined = set(frontier)
        depth = self.options.backward_depth + (3 if self.options.context_parallel else 0)
        for _ in range(depth):
            frontier = [arg for name in frontier
                        for arg in self._upstream(name, defined, known, region)]
        exchanged = [name for name in defined if self.dist.graph[name].op == "all_to_all"]
        for name in exchanged:
            self._upstream(name, defined, known, region)
        return sorted(defined, key=self.dist.order.get)

    def _upstream(self, name: str, defined: set[str], known: set[str], region: str) -> list[str]:
        """The arguments of `name` to define next (added to `defined`): computed in `region`
        (with context parallelism, movement ops from outside it too), not yet defined."""
        across = self.options.context_parallel
        found = []
        for arg in self.dist.graph[name].inputs:
            node = self.dist.graph[arg]
            if (arg in defined or arg in known or arg in self.dist_const
                    or node.op in _UNDEFINED or self.region[arg] != region
                    and not (across and OPS[node.op].trait == MOVEMENT)):
                continue
            defined.add(arg)
            found.append(arg)
        return found

    def _definitions(self, names: list[str]) -> list[str]:
        """A union of each rank tensor with its definition; opaque ones and inputs stay
        undefined (free values, about which nothing is known: every rank's parameter of one name
        has the same placeholder term, and is not the same value)."""
        return [f"(union {leaf(name)} {self._definition(name)})" for name in names
                if self.dist.graph[name].op not in _UNDEFINED]

    def _definition(self, name: str) -> str:
        node = self.dist.graph[name]
        args = [self.dist_const[a] if a in self.dist_const else leaf(a)
                for a in node.inputs]
        return encode(node, args, [self.dist.graph[a].shape for a in node.inputs])

    def _sizes(self, lines: list[str]) -> list[str]:
        """The dim sizes of every rank tensor and constant `lines` name (size-dependent rules
        read them), and where those constants come from."""
        text = "\n".join(lines)
        names = dict.fromkeys(_LEAF_NAME.findall(text))  # in order of appearance
        counts = reads_dim_counts(text)
        return [*(fact for name in names
                  for fact in shape_facts(leaf(name), self.dist.graph[name].shape, counts)),
                *self.constants.facts(text, counts)]

    # Outputs.

    def _check_outputs(self, placements: list[Placement], relations: dict[str, Relation | None],
                       result: Verification) -> None:
        if self._past_deadline():
            result.unknown.append("the outputs' placements: not checked, the run's deadline "
                                  "passed first")
            return
        for position, (output, placement) in enumerate(zip(self.ref.outputs, placements)):
            relation = relations[output]
            if relation is None:
                continue
            rank_outputs = [self.dist.rank_outputs[rank][index] for rank, index
                            in output_holders(placements, position, len(self.dist.rank_outputs))]
            shapes = [self.dist.graph[n].shape for n in rank_outputs]
            held = Replicate() if isinstance(placement, Stage) else placement  # on its one rank
            expected = self._expected_output(held, rank_outputs, shapes, self.ref[output].shape)
            if self._same_elements(relation, expected, relations):
                continue
            known = set(relation.leaf_names())
            region = self.region[rank_outputs[0]]
            # From the relation's rank tensors down, and from the rank outputs up: ops between
            # the last related tensor and an output (a reorder, a cut and rejoin) may be deeper
            # than a window.
            window = self._window(known, region, self.options.window_depth, look_through=True)
            window += [n for n in rank_outputs if n not in known and n not in window]
            defined = self._with_dependencies(window, known, sorted(known, key=self.dist.order.get),
                                              region)
            lines = ([f"(let $y {relation.term})", f"(inv {relation.term})"] +
                     [f"(union {t} {leaf(n)})" for t, n in relation.facts()] +
                     self._definitions(defined))
            program = "\n".join(lines + self._sizes(lines + expected))
            try:
                holds = self.session.holds(program, expected)
            except NoAnswer as limit:
                result.unknown.append(f"output {position} ({placement}): its check gave no "
                                      f"answer, {limit}")
                continue
            opaque = self.dist_opaque.intersection(rank_outputs)
            if not holds and opaque:
                result.unknown.append(f"output {position} ({placement}): the ranks compute it "
                                      "from ops with no lowering to the core IR "
                                      f"({opaque_sources(self.dist.graph, opaque)})")
            elif not holds:
                result.discrepancies.append(self._output_discrepancy(
                    self.ref[output], relation, placement, rank_outputs, relations))

    def _same_elements(self, relation: Relation, expected: list[str],
                       relations: dict[str, Relation | None]) -> bool:
        """Whether the relation and every expected term hold the same elements, numbered by
        how they were computed (elements.py), in the same places."""
        if self.dist.symbolic:
            return False
        origins = self._origins(relations)
        ids = origins.of(parse(relation.term))
        if ids is None:
            return False
        for term in expected:
            theirs = origins.of(parse(term))
            if theirs is None or theirs.shape != ids.shape or not torch.equal(theirs, ids):
                return False
        return True

    def _expected_output(self, placement: Placement, rank_outputs: list[str],
                         shapes: list[Shape], ref_shape: Shape) -> list[str]:
        """Terms a reference output must equal: Custom ones (fused gradients) from the rank
        outputs laid out as the rank tensors their pieces name, the rest as `expected_output`."""
        if isinstance(placement, Custom) and self.dist.symbolic:
            return [family_custom_relation(placement, ref_shape, rank_outputs[0], shapes[0],
                                           self.dist.world_size).term]
        if isinstance(placement, Custom):
            return custom_output_terms(placement, ref_shape, rank_outputs, shapes)
        return expected_output(placement, rank_outputs, shapes, ref_shape, self.dist.world_size,
                               self.dist.symbolic)

    # Diagnostics.

    def _collective_receiving(self, name: str) -> Node | None:
        """The collective that receives rank tensor `name`, directly or through data movement
        and scalings (a partial sum scaled is still one)."""
        names = {name}
        for node in self.dist.graph:
            if names & set(node.inputs):
                if node.op in COLLECTIVES:
                    return node
                if OPS[node.op].trait == MOVEMENT or node.op in LINEAR_UNARY_OPS:
                    names.add(node.name)
        return None

    def _first_uses(self, name: str, limit: int = 4) -> list[SourceLoc]:
        """The lines of the first ops past data movement that read rank tensor `name` (what the
        ranks do with a collective's result: scale it, add it) and, past its scalings, of the
        ops that make it an output, each with the data movement that took the value there (a
        gradient's partition cut out of a flat bucket, read back out of it)."""
        outputs = set(self.dist.graph.outputs)
        uses: list[SourceLoc] = []
        reader = {name: name}  # each op reached, and the op it reads the value from
        queue = deque([name])
        while queue and len(uses) < limit:
            current = queue.popleft()
            for user in self.users[current]:
                if user in reader:
                    continue
                reader[user] = current
                node = self.dist.graph[user]
                moves = OPS[node.op].trait == MOVEMENT
                if moves or node.op in LINEAR_UNARY_OPS:
                    queue.append(user)
                if not moves or user in outputs:  # with the ops that cut or scaled it there
                    uses += [loc for loc in dict.fromkeys(
                        self.dist.graph[n].source for n in self._read_from(user, name, reader))
                        if loc.file and loc not in uses]
        return uses

    @staticmethod
    def _read_from(name: str, source: str, reader: dict[str, str]) -> list[str]:
        """The ops from `name` back to (not including) `source`, each reading the next."""
        trail = []
        while name != source:
            trail.append(name)
            name = reader[name]
        return trail

    def _discrepancy(self, node: Node, inputs: list[Relation], found: App, window: list[str],
                     relations: dict[str, Relation | None]) -> Discrepancy:
        described = [describe(parse(r.term), self.labels) for r in inputs]
        lowest = [n for n in window if self.dist.rank_of(n) == min(
            (self.dist.rank_of(w) for w in window), default=0)]
        partials = [(i, _partial(parse(r.term))) for i, r in enumerate(inputs)]
        partial = next(((i, found) for i, found in partials if found), None)
        path: list[SourceLoc] = []  # the rank ops from the last values known equal to this op
        if partial is not None:
            position, (kind, term) = partial
            producer = self.dist.graph[leaves(term)[0]]
            primary = producer.source
            path = self._parted_path(producer.name, inputs, found, relations)
            hint = (f"input {position} is a partial {kind} over ranks (from {producer.source}): "
                    f"an all_reduce is missing before this {node.op}")
            names = leaves(term)
            if not self.dist.symbolic and len({self.dist.rank_of(n) for n in names}) == 1:
                hint = (f"input {position} is a sum of parts that rank "
                        f"{self.dist.rank_of(names[0])} computes separately (e.g. per micro-batch, "
                        f"from {producer.source}) but never adds up before this {node.op}")
            collective = self._collective_receiving(producer.name)
            if collective is not None:  # the partial sum is sent, but not summed into this value
                path += [loc for loc in [collective.source, *self._first_uses(collective.name)]
                         if loc not in path]
                hint = (f"input {position} is a partial {kind} over ranks (from "
                        f"{producer.source}) that the {collective.op} at {collective.source} "
                        f"does not sum into this {node.op}'s input")
        else:
            same_op = sorted((n for n in lowest if self.dist.graph[n].op == node.op),  # in the
                             key=lambda n: self.dist.graph[n].source.backward  # same pass first
                             != node.source.backward)
            lines = {(loc.file, loc.line) for loc in [node.source, *(self.ref[i].source
                                                                    for i in node.inputs)]
                     if loc.file}  # the rank's run of this op's or its inputs' source lines
            same_line = [n for n in lowest if (self.dist.graph[n].source.file,
                                               self.dist.graph[n].source.line) in lines]
            chosen = (self._selected_elsewhere(inputs, lowest) or same_op or same_line or lowest
                      or [None])[0]
            primary = self.dist.graph[chosen].source if chosen else SourceLoc()
            hint = _hint(node, found) + _layout_hint(self._sharded_inputs(node))
            if chosen:
                path = self._parted_path(chosen, inputs, found, relations)
        blamed = producer.name if partial is not None else chosen
        if blamed:  # and where the value it reads was scaled, cut and laid out
            upstream = (chain_lines(self.dist.graph, blamed) + cut_lines(self.dist.graph, blamed)
                        + self._misread_chains(node, inputs, blamed, relations))
            path += [loc for loc in upstream if loc not in path and loc != primary]
        path += [loc for loc in self._constants_read([primary, *path])
                 if loc not in path and loc != primary]
        nearby = list(dict.fromkeys(self.dist.graph[n].source for n in lowest))[:10]
        return Discrepancy(node.op, node.name, node.source.module, node.source, primary,
                           found=describe(found, self.labels),
                           expected="a relation to the ranks' tensors (Replicate, Shard or Partial)",
                           hint=hint, inputs=described, nearby=nearby, path=path,
                           placements=self._sharded_parameters(node))

    def _constants_read(self, path: list[SourceLoc]) -> list[SourceLoc]:
        """Where the constants that the ranks' ops on `path`'s lines read were computed (a mask
        from positions, a table from offsets): the Python arithmetic behind them is no op of
        the path, yet a wrong offset there is the bug."""
        graph = self.dist.graph
        pending = [i for loc in path if loc.file for n in self._nodes_at.get((loc.file, loc.line), ())
                   for i in graph[n].inputs if i in self.dist_const]
        found, seen = {}, set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            source = graph[name].source
            if source.file:
                found.setdefault((source.file, source.line), source)
            pending += [i for i in graph[name].inputs if i in self.dist_const]
        return list(found.values())

    @cached_property
    def _nodes_at(self) -> dict[tuple[str, int], list[str]]:
        """The ranks' nodes by source line."""
        at: dict[tuple[str, int], list[str]] = {}
        for node in self.dist.graph:
            at.setdefault((node.source.file, node.source.line), []).append(node.name)
        return at

    def _misread_chains(self, node: Node, inputs: list[Relation], blamed: str,
                        relations: dict[str, Relation | None]) -> list[SourceLoc]:
        """The lines that laid out each operand of the blamed rank op (applying the reference
        op's op) that holds elements the reference operand does not hold (elements.py): k
        and v swapped at a split, a block read from the wrong offset."""
        rank_node = self.dist.graph[blamed]
        if (self.dist.symbolic or rank_node.op != node.op
                or len(rank_node.inputs) != len(inputs)):
            return []
        origins = self._origins(relations)
        lines: list[SourceLoc] = []
        for relation, name in zip(inputs, rank_node.inputs):
            wanted = origins.of(parse(relation.term))
            theirs = origins.of(App("dist", (name,)))
            if wanted is not None and theirs is not None and not set(
                    theirs.reshape(-1).tolist()) <= set(wanted.reshape(-1).tolist()):
                lines += chain_lines(self.dist.graph, name)
        return lines

    def _parted_path(self, blamed: str, inputs: list[Relation], found: App,
                     relations: dict[str, Relation | None], limit: int = 6) -> list[SourceLoc]:
        """Where the rank op blamed and the reference part ways: the ops it and the rank
        tensors the saturation found depend on, back to (and including) the rank tensors
        equal to the reference op's inputs, or to tensors equal to other reference values
        (read in their place: a swapped chunk), nearest first, at most `limit` lines other than the blamed
        op's. A wrong slice, chunk order, shard or scaling upstream shows here, and so do
        the rank's own constants the reference has none of (a table cut at the wrong rows)."""
        in_part = {name for relation in inputs for name in read_in_part(
            parse(relation.term), {n: self.dist.graph[n].shape for n in relation.leaf_names()
                                   if n in self.dist.graph})}
        expected = {name for relation in inputs for name in relation.leaf_names()} - in_part
        known = {name for relation in relations.values() if relation is not None
                 for name in relation.leaf_names()} - in_part
        starts = [blamed, *(n for n in leaves(found) if n not in expected and n in self.dist.graph)]
        lines: list[SourceLoc] = [self.dist.graph[blamed].source]
        seen, queue = set(starts), deque(starts)
        while queue and len(lines) <= limit:
            name = queue.popleft()
            node = self.dist.graph[name]
            for line in (node.source, *self.dist.sent_at.get(name, ())):  # and the sends it took
                if line.file and line not in lines:
                    lines.append(line)
            if name in known and name not in starts or name in expected:
                continue  # a value known equal to the reference's: where the ways part
            for arg in node.inputs:
                read = self.dist.graph[arg]
                if read.op == "placeholder" and read.source.passed_at:  # copied before it
                    held = replace(read.source, code=f"the input {arg}, passed on")  # was read
                    lines += [held] if held not in lines else []
                elif arg not in seen and self.dist_const.get(arg) not in self.ref_const_terms \
                        and read.op != "placeholder":
                    seen.add(arg)
                    queue.append(arg)
        return lines[1:]

    def _selected_elsewhere(self, inputs: list[Relation], window: list[str]) -> list[str]:
        """Rank slices in `window` that cut another part of the same size from a rank tensor
        an input's relation reads a slice of: the ranks hold the value the reference uses,
        but took another part of that tensor."""
        read, stack = set(), [parse(r.term) for r in inputs]
        while stack:
            term = stack.pop()
            if isinstance(term, App):
                part = term.args[0] if term.head == "slice" else None
                if isinstance(part, App) and part.head == "dist":
                    _, dim, start, end = term.args
                    read.add((part.args[0], dim, end - start, start))
                stack.extend(term.args)
        found = []
        for name in window:
            node = self.dist.graph[name]
            start, end = node.attr("start"), node.attr("end")
            if node.op == "slice" and isinstance(start, int) and isinstance(end, int):
                cut = (node.inputs[0], node.attr("dim"), end - start)
                starts = {start for *where, start in read if tuple(where) == cut}
                if starts and start not in starts:
                    found.append(name)
        return found

    def _sharded_parameters(self, node: Node) -> list[str]:
        """Placements (and where they were declared) of the sharded parameters of this layer
        that the op depends on: a wrong placement shows up here, not on a line of the graph."""
        return sorted(f"{target}: {placement} (declared at {placement.declared_at})"
                      for target, placement in self._sharded_inputs(node).items())

    def _sharded_inputs(self, node: Node) -> dict[str, Placement]:
        """The non-replicated parameters of this layer the op depends on, by name."""
        region, seen, stack, found = region_of(node.source.module), set(), [node.name], {}
        while stack:
            current = self.ref[stack.pop()]
            if current.name in seen:
                continue
            seen.add(current.name)
            if current.op == "placeholder":
                placement = self.placements.get(current.attr("target"), Replicate())
                if not isinstance(placement, Replicate):
                    found[current.attr("target")] = placement
            elif region_of(current.source.module) == region:
                stack.extend(current.inputs)
        return found

    def _output_discrepancy(self, node: Node, relation: Relation, placement: Placement,
                            rank_outputs: list[str], relations: dict[str, Relation | None]
                            ) -> Discrepancy:
        term = parse(relation.term)
        first = leaves(term)
        source = self.dist.graph[first[0]].source if first else SourceLoc()
        cuts = cut_lines(self.dist.graph, first[0], limit=3) if first else []
        carried = self._partial_carriers(node.name, relations) if _partial(term) else []
        return Discrepancy(
            "output", node.name, node.source.module, node.source, source,
            found=describe(term, self.labels), expected=f"{placement} of the rank outputs",
            hint=f"the output relates to the ranks as {describe(term, self.labels)}, not as "
                 f"{placement}: check the last collective before the output",
            path=list(dict.fromkeys([*carried, *cuts,
                                     *(self.dist.graph[n].source for n in rank_outputs[:1])])))

    def _partial_carriers(self, output: str, relations: dict[str, Relation | None],
                          limit: int = 6) -> list[SourceLoc]:
        """The rank ops that carry a partial sum to `output`, from where it arises on: the
        reduction over ranks is missing on one of them (a layer returning its partial sum, a
        backward region passing the gradient on without its all-reduce)."""
        region, seen, stack = [], {output}, [output]
        while stack:
            name = stack.pop()
            relation = relations.get(name)
            if relation is None or _partial(parse(relation.term)) is None:
                continue
            region.append(name)
            for arg in self.ref[name].inputs:
                if arg not in seen:
                    seen.add(arg)
                    stack.append(arg)
        order = {node.name: index for index, node in enumerate(self.ref)}
        lines: list[SourceLoc] = []
        for name in sorted(region, key=order.get):
            for rank_name in relations[name].leaf_names():
                loc = self.dist.graph[rank_name].source
                if loc.file and loc not in lines and len(lines) < limit:
                    lines.append(loc)
        return lines


def _sums_split_contraction(node: Node, candidates: list[Node]) -> bool:
    """Whether the ranks may compute `node`, a contraction, as parts summed over ranks (a
    reduction among `candidates`): then only matmul elements numbered as their unexpanded
    products (costly in a large program, so tried last) give the parts' sum the whole's ids."""
    return OPS[node.op].trait == MATMUL and any(
        c.op in ("all_reduce", "reduce_scatter") for c in candidates)


def _inherited(inputs: list[Relation], mentioned: set[str]) -> tuple[tuple[str, str], ...]:
    """The inputs' own replica facts, and older ones about rank tensors still mentioned."""
    kept = [fact for relation in inputs for fact in relation.aliases]
    for relation in inputs:
        for term, name in relation.inherited:
            if name in mentioned or mentioned.intersection(leaves(parse(term))):
                kept.append((term, name))
    return tuple(dict.fromkeys(kept))


def _layout_hint(inputs: dict[str, Placement]) -> str:
    """For Custom (fused) layouts: where they were stated, e.g. a sharding function's line."""
    stated = sorted({p.declared_at for p in inputs.values() if isinstance(p, Custom)})
    if not stated:
        return ""
    return (f"; or the layout the ranks hold (stated at {', '.join(stated)}) differs from the one "
            "their code uses")


_PARTIALS = {"psum": "sum", "rsum": "sum", "pmax": "max", "rmax": "max"}


def _partial(term) -> tuple[str, App] | None:
    """("sum" or "max", the reduction) when a relation is a partial reduction over ranks, under
    any broadcasts and size-1 reshapes."""
    while isinstance(term, App) and term.head in ("expand", "unsqueeze", "squeeze"):
        term = term.args[0]
    if isinstance(term, App) and term.head in _PARTIALS:
        return _PARTIALS[term.head], term
    return None


def _label(node: Node, ranks: str) -> str:
    where = f"{node.source.module or 'top'}" + (f" @ {node.source}" if node.source.file else "")
    return f"{ranks}: {node.op} ({where})"


def _hint(node: Node, found: App) -> str:
    trait = OPS[node.op].trait
    operand = found.args[1] if trait in ("reduce", "softmax") and len(found.args) > 2 else None
    sharded_dim = None
    if isinstance(operand, App) and operand.head == "concat":
        sharded_dim = operand.args[2]
    elif isinstance(operand, App) and operand.head == "rcat":
        sharded_dim = operand.args[1]
    if sharded_dim is not None and sharded_dim == found.args[2]:
        return (f"{node.op} over dim {found.args[2]}, which is sharded across ranks, with no "
                "reduction across ranks")
    if trait == "movement":
        return ("the ranks move data differently from the reference here (a global size used on "
                "a local shard, or a wrong dim)")
    return ("no rank computes this value from its inputs' relations; compare the reference line "
            "with the distributed lines listed")


@functools.lru_cache(maxsize=65536)
def _bare_leaf(term: str) -> str | None:
    """The rank tensor a relation term is, when it is one rank tensor (a whole value)."""
    match = _LEAF_NAME.fullmatch(term)
    return match.group(1) if match else None


def _relational_parts(text: str) -> list[str]:
    """A relation term, or for a pending one (reference ops over relations) its maximal
    relational subterms: the values the ranks hold."""
    parts, stack = [], [parse(text)]
    while stack:
        term = stack.pop()
        if is_relational(term):
            parts.append(render(term))
        else:
            stack.extend(a for a in term.args if isinstance(a, App))
    return parts
