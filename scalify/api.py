"""The public entry points: verify an experiment config, or modules a user brings."""
from __future__ import annotations

import copy
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .capture.dtensor import placements_held
from .capture.hlo import lower_module
from .capture.hlo_relations import (infer_output_placements, infer_placements as infer_hlo_placements,
                                    match_inputs, rename_inputs)
from .capture.hlo_text import HloModule, parse_module
from .capture.jax_dump import JaxDump, dump_jax
from .capture.ranks import capture_ranks
from .capture.sampled_reads import Sample, sample_reads
from .capture.shard_fn import ShardFn, stated_placements
from .capture.source_patches import source_patches
from .capture.tracer import capture
from .config import Experiment, load_experiment
from .engine import Executor, InlineExecutor, VerifyJob, executor_for
from .errors import CaptureError, DataDependentRead, ShapeError
from .ir.assumptions import ValueRange, assuming
from .ir.masks import EXCLUDING_FILL, excluding_fills
from .ir.roundings import ULPS, factors_as_reference
from .ir.broadcasts import with_broadcasts_resolved
from .ir.distributed import merge_ranks
from .ir.graph import Graph
from .ir.ops import MOVEMENT, OPS
from .ir.scaling import pushed_scales, scaling_nodes
from .ir.simplify import simplified, simplified_ranks, without_zero_shifts
from .ir.slabs import held_as_slabs
from .ir.symmetry import symbolic_program
from .placements import Custom, Placement, Replicate, Shard, slabbed
from .report.model import Discrepancy, Report
from .programs import programs_for
from .rules import context
from .verify.numeric import cross_check, rank_values
from .verify.relations import even_placements
from .verify.session import WindowLimits
from .verify.store import ProofStore
from .verify.verifier import VerifyOptions

Progress = Callable[[str, int, int], None]


def _quiet(stage: str, done: int, total: int) -> None:
    return None


def verify_modules(reference: nn.Module, rank_module_factory: Callable[[int], nn.Module],
                   world_size: int, example_inputs: dict[str, torch.Tensor] | tuple,
                   param_placements: dict[str, Placement] | None = None,
                   input_placements: dict[str, Placement] | None = None,
                   output_placements: list[Placement] | None = None, *, numeric: bool = False,
                   name: str = "modules", progress: Progress = _quiet,
                   options: VerifyOptions | None = None, capture_workers: int = 1,
                   executor: Executor | None = None, grad: bool = False,
                   shard_fn: ShardFn | None = None,
                   assume: Mapping[str, tuple[int, int]] | None = None) -> Report:
    """Prove that `rank_module_factory(r)` for r < world_size computes what `reference` computes.

    `example_inputs` are reference-shaped tensors (meta, fake or real) passed to both forwards
    as keyword arguments (a tuple is named arg0, arg1, ...); `param_placements` maps reference
    parameter/buffer names to placements (unlisted: as the ranks hold them when they are
    DTensors, e.g. after `parallelize_module`; else Replicate); outputs default to Replicate.
    `capture_workers > 1` captures ranks in forked processes as well as this one; `executor`
    (default: inline) proves the segments. With `grad`, both are captured with autograd on, so
    modules that return gradients (see `scalify.steps.training_step`) have their backward
    pass verified too. `shard_fn(reference_state, rank, world_size) ->
    rank_state`, a checkpoint sharding function, states the parameters' placements instead
    (read by `infer_placements`; `param_placements` still override it). `assume` bounds
    integer inputs (name -> inclusive (low, high), e.g. labels never the ignore index): the
    proof then holds for inputs within those ranges, and the report says so.
    """
    input_placements = input_placements or {}
    timings: dict[str, float] = {}
    start = time.perf_counter()
    stated = stated_placements(reference, world_size, param_placements, shard_fn)
    ref_graph, rank_graphs, sample = _captured(
        reference, rank_module_factory, world_size, _named(example_inputs), input_placements,
        {**stated, **input_placements}, progress, capture_workers, grad)
    timings["capture_s"] = time.perf_counter() - start
    start = time.perf_counter()
    rank_graphs = [held_as_slabs(graph, slabbed(stated)) for graph in rank_graphs]
    placements = {**placements_held(rank_graphs), **stated, **input_placements}
    outputs = output_placements or [Replicate()] * len(ref_graph.outputs)
    return verify_graphs(ref_graph, rank_graphs, placements, outputs,
                         numeric=numeric or sample is not None, name=name, progress=progress,
                         options=options, executor=executor, timings=timings, started=start,
                         assume=assume, sample_values=sample and sample.values)


def capture_modules(reference: nn.Module, rank_module_factory: Callable[[int], nn.Module],
                    world_size: int, example_inputs: dict[str, torch.Tensor] | tuple,
                    input_placements: dict[str, Placement], *, progress: Progress = _quiet,
                    capture_workers: int = 1, grad: bool = False) -> tuple[Graph, list[Graph]]:
    """The reference graph and the rank graphs, as `verify_modules` captures them."""
    return _captured(reference, rank_module_factory, world_size, _named(example_inputs),
                     input_placements, input_placements, progress, capture_workers, grad)[:2]


def _captured(reference: nn.Module, factory: Callable[[int], nn.Module], world_size: int,
              inputs: dict[str, torch.Tensor], input_placements: dict[str, Placement],
              placements: dict[str, Placement], progress: Progress, capture_workers: int,
              grad: bool) -> tuple[Graph, list[Graph], Sample | None]:
    """Both programs' graphs. A program that reads its data into Python (an MoE router's token
    counts) is first run on real numbers, the ranks' weights cut by `placements`, and captured
    again replaying what it read (sampled_reads.py); that sample is returned too."""
    local = lambda values, rank: _local_inputs(values, input_placements, rank, world_size)

    def captured(sample: Sample | None) -> tuple[Graph, list[Graph]]:
        # (replaying, on meta tensors, as the ranks are)
        held = {name: t.to("meta") for name, t in inputs.items()} if sample else inputs
        ref = copy.deepcopy(reference).to("meta") if sample else reference
        ref_graph = capture(ref, lambda: _call(ref, held), held, grad=grad,
                            replay=sample and sample.reference)
        rank_graphs = capture_ranks(
            factory, world_size, lambda rank: local(held, rank), _call,
            lambda rank: progress("capture", rank + 1, world_size), workers=capture_workers,
            grad=grad, replays=sample and sample.ranks)
        return ref_graph, rank_graphs

    try:
        return (*captured(None), None)
    except DataDependentRead:
        progress("sample reads on real numbers", 0, 1)
        sample = sample_reads(
            reference, factory, world_size, inputs, local,
            lambda values, rank, shapes: rank_values(placements, values, rank, world_size, shapes),
            _call, grad)
        progress("sample reads on real numbers", 1, 1)
        return (*captured(sample), sample)


@dataclass
class _Attempt:
    """One proof attempt on one form of the programs: the merged (or symbolic) ranks it proves
    against, and once run, its verification."""

    reference: Graph
    program: Any  # the symbolic program, or the merged ranks
    dist: Any  # the merged ranks where needed (no symmetry, or the numbers are run), else None
    symmetry: str
    moved: bool = False
    result: Any = None
    engine_stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, ref_graph: Graph, rank_graphs: list[Graph], placements: dict[str, Placement],
           options: VerifyOptions, numeric: bool, moved: bool = False) -> _Attempt:
        symbolic, symmetry = None, "off"
        if options.rank_symmetry:
            symbolic, symmetry = (
                symbolic_program(rank_graphs) if even_placements(placements, len(rank_graphs))
                else (None, "a placement repeats chunks across ranks, is Custom with pieces "
                      "other than even blocks, or is Stage (pipeline stages run different "
                      "programs)"))
        # The per-rank graph is needed to verify without symmetry and to run the numbers.
        if symbolic is None:
            rank_graphs = [without_zero_shifts(graph) for graph in rank_graphs]
        dist = merge_ranks(rank_graphs) if symbolic is None or numeric else None
        return cls(ref_graph, symbolic or dist, dist, symmetry, moved)

    @property
    def verified(self) -> bool:
        return not self.result.discrepancies and not self.result.unknown

    def run(self, executor: Executor, options: VerifyOptions, placements: dict[str, Placement],
            outputs: list[Placement], progress: Progress, stage: str) -> None:
        job = VerifyJob(self.reference, self.program, options, placements, outputs)
        self.result, self.engine_stats = executor.run(
            job, lambda done, total: progress(stage, done, total))

    def better(self, moved: _Attempt) -> _Attempt:
        """The attempt to report, this one being the code as written (its first discrepancy
        at a scaling): `moved` if it verifies or finds discrepancies too (the two forms differ
        at scalings, and `moved` tells whether the scales agree), else this one; this one too
        when `moved` first parts at a reference op before this one's first discrepancy (an op
        the code as written was proved at: a factor written down where the ranks' was not).
        `moved` when the deadline cut it short before any discrepancy: unknown, since the form
        that decides scalings might have verified."""
        if moved.verified or moved.result.unchecked and not moved.result.discrepancies:
            return moved
        if not moved.result.discrepancies:
            return self
        order = {node.name: index for index, node in enumerate(self.reference)}
        mine = order[self.result.discrepancies[0].ref_node]
        theirs = _position(order, moved.reference.users(), moved.result.discrepancies[0].ref_node)
        return self if theirs < mine else moved


def _position(order: dict[str, int], users: dict[str, list[str]], name: str) -> int:
    """The place in the code as written of a node of its moved form: its own, or for a node
    the moving added (a factor written down) its first user's (the end, for an output)."""
    if name in order:
        return order[name]
    return min((_position(order, users, user) for user in users.get(name, ())),
               default=len(order))


def _at_scaling(graph: Graph, name: str) -> bool:
    """Whether node `name` scales a value, or a scaling reads its value (moved or not)."""
    scalings, users = scaling_nodes(graph), graph.users()
    reached = [name]
    while reached:
        current = reached.pop()
        if current in scalings:
            return True
        reached += [user for user in users.get(current, ())
                    if user in scalings or OPS[graph[user].op].trait == MOVEMENT]
    return False


def _rewritten(before: Graph, after: Graph) -> bool:
    return [(n.name, n.op, n.inputs) for n in before] != [(n.name, n.op, n.inputs) for n in after]


def verify_graphs(ref_graph: Graph, rank_graphs: list[Graph], placements: dict[str, Placement],
                  outputs: list[Placement], *, numeric: bool = False, name: str = "graphs",
                  progress: Progress = _quiet, options: VerifyOptions | None = None,
                  executor: Executor | None = None, timings: dict[str, float] | None = None,
                  started: float | None = None,
                  assume: Mapping[str, tuple[int, int]] | None = None,
                  sample_values: Mapping[str, torch.Tensor] | None = None) -> Report:
    """Prove that the rank graphs compute what the reference graph computes, given captured
    graphs (any frontend): `placements` relate the reference's inputs (by placeholder name) to
    the ranks', `outputs` state each output's expected placement. `timings` (e.g. the capture's)
    are kept in the report; `started` is when the lowering stage began (default: now).
    `assume` bounds integer inputs as in `verify_modules`. Graphs that replay reads of their
    data (`Graph.sampled_reads`) are proved for inputs read that way only: the verdict is then
    at best unknown, and the numbers run on `sample_values`, the sampled run's."""
    timings = dict(timings or {})
    sampled = tuple(dict.fromkeys(line for graph in (ref_graph, *rank_graphs)
                                  for line in graph.sampled_reads))
    start = time.perf_counter() if started is None else started
    assumed = {name: ValueRange(*bounds) for name, bounds in (assume or {}).items()}
    written_ref, written_ranks = ref_graph, rank_graphs
    rank_graphs, rounded = factors_as_reference(ref_graph, rank_graphs)
    ref_graph = without_zero_shifts(simplified(assuming([ref_graph], assumed)[0]))
    replicated = lambda target: isinstance(placements.get(target, Replicate()), Replicate)
    rank_graphs = simplified_ranks(with_broadcasts_resolved(assuming(rank_graphs, assumed),
                                                            replicated))
    excluding = list(dict.fromkeys(line for before, after in zip(
        (written_ref, *written_ranks), (ref_graph, *rank_graphs))
        for line in excluding_fills(before, after)))
    options = options or VerifyOptions()
    if not options.context_parallel and context.needed(ref_graph, rank_graphs):
        options = replace(options, context_parallel=True)
    # (the numbers run on the programs as written: merged here only when nothing was assumed)
    attempt = _Attempt.of(ref_graph, rank_graphs, placements, options, numeric and not assumed)
    timings["lowering_s"] = time.perf_counter() - start
    start = time.perf_counter()
    # (one store for both attempts: the windows the moving leaves alone are proved once)
    executor = executor or InlineExecutor(
        ProofStore(":memory:") if options.memo and not options.memo_store else None)
    attempt.run(executor, options, placements, outputs, progress, "verify")
    first = attempt.result.discrepancies[:1]
    origin = first and attempt.result.run_origins.get(first[0].ref_node)
    if first and any(_at_scaling(ref_graph, name) for name in (first[0].ref_node, origin) if name):
        # The same math may scale at other places on the ranks (a mean per rank, then a sum
        # over ranks; a query and a key scaled before their product, its scores after): when
        # the first discrepancy is at a scaling, or at the value one reads (or in a run of ops
        # begun there), a second attempt with every scalar factor moved to where it matters.
        scaled_ref, *scaled_ranks = pushed_scales([ref_graph]) + pushed_scales(rank_graphs)
        if any(map(_rewritten, [ref_graph, *rank_graphs], [scaled_ref, *scaled_ranks])):
            moved = _Attempt.of(scaled_ref, scaled_ranks, placements, options, False, moved=True)
            moved.run(executor, options, placements, outputs, progress, "verify (factors moved)")
            attempt = attempt.better(moved)
    result, engine_stats = attempt.result, attempt.engine_stats
    timings["verify_s"] = time.perf_counter() - start
    numeric_result = None
    if numeric:  # the programs as written, on inputs within the assumed ranges
        start = time.perf_counter()
        dist = attempt.dist if attempt.dist is not None and not assumed else merge_ranks(
            written_ranks)
        numeric_result = cross_check(written_ref, dist, placements, outputs, assumed=assumed,
                                     values=sample_values)
        timings["numeric_s"] = time.perf_counter() - start
    timings["total_s"] = sum(timings.values())
    discrepancies = result.discrepancies or _refuted(result, numeric_result)
    unknown = list(result.unknown)
    if sampled and discrepancies and (numeric_result or {}).get("agrees") is not False:
        # Indices computed from the data are opaque to the rules: past them, an op not proved
        # is a discrepancy only when the numbers differ too.
        first = discrepancies[0]
        unknown.append(f"{first.ref_op} at {first.location}: not proved, and the numbers of "
                       "the sampled run agree")
        discrepancies = []
    if sampled and not discrepancies:
        unknown.append(_sampled_only(sampled))
    verified = not discrepancies and not unknown
    stats = {"world_size": len(rank_graphs), "reference_nodes": len(ref_graph),
             "distributed_nodes": sum(len(g) for g in rank_graphs), "windows": result.windows,
             "memo_hits": result.memo_hits, "memo_misses": result.memo_misses,
             "layer_memo_hits": result.layer_hits, "rule_matches": result.rule_matches,
             "largest_egraph_nodes": result.largest_egraph,
             "blocked_ops": result.blocked, "rank_symmetry": attempt.symmetry,
             "scalar_factors": "moved" if attempt.moved else "as written",
             **_assumptions(assumed, excluding, rounded), **engine_stats}
    verdict = "discrepancy" if discrepancies else "unknown" if unknown else "verified"
    return Report(name, verified, verdict, discrepancies, timings, stats, numeric_result,
                  unknown=unknown)


def _assumptions(assumed: dict[str, ValueRange], excluding: list[str],
                 rounded: list[str]) -> dict[str, Any]:
    """What the proof assumed, for the report: input ranges, softmax scores masked by a large
    finite fill taken as masked by -inf (`ir/masks.py`), and rank factors taken as the
    reference's they round (`ir/roundings.py`)."""
    stated: dict[str, Any] = {name: str(bounds) for name, bounds in assumed.items()}
    if rounded:
        stated["scalar factors"] = (f"a factor within {ULPS} units in the last place of the "
                                    f"reference's is the same real, at {', '.join(rounded)}")
    if excluding:
        stated["softmax fills"] = (
            f"a fill of {EXCLUDING_FILL:g} or less weighs 0 after its softmax, as -inf does (in "
            f"float32, while a row's scores lie within {-EXCLUDING_FILL - 104:g} of its "
            f"largest), at {', '.join(excluding)}")
    return {"assumed": stated} if stated else {}


def _sampled_only(lines: tuple[str, ...]) -> str:
    return (f"proved only for inputs the programs read as a sampled run did: what they read of "
            f"their data at {', '.join(lines)} (token counts, a mask's positions) was fixed to "
            "that run's values, and other inputs may take other paths")


def _refuted(result: Any, numeric: dict[str, Any] | None) -> list[Discrepancy]:
    """Where the proof stopped, as a discrepancy, when it stopped at a window's limits and the
    numbers differ: the ranks do not compute the reference, and every op before that one is
    proven, so it is the first op where the two may part ways."""
    if not result.suspects or not numeric or numeric.get("agrees") is not False:
        return []
    first = result.suspects[0]
    error = numeric["max_relative_error"]
    return [replace(first, hint=f"{first.hint}; the numbers differ (max relative error "
                                f"{error:.3g}), so the ranks do not compute the reference, and "
                                "this is the first op the proof did not reach past")]


def verify(config: str | os.PathLike | dict | Experiment, *, numeric: bool | None = None,
           progress: Progress = _quiet, executor: Executor | None = None) -> Report:
    """Verify the experiment a YAML file (or dict, or loaded Experiment) describes, on `executor`
    (default: the one its `engine` section asks for)."""
    experiment = config if isinstance(config, Experiment) else load_experiment(config)
    if experiment.hlo is not None:
        report = _verify_hlo_experiment(
            experiment, numeric=experiment.verify.numeric if numeric is None else numeric,
            progress=progress, executor=executor or executor_for(experiment.engine))
        return _finish(report, experiment)
    with source_patches([Path(diff) for diff in experiment.plan.patches]) as patched:
        programs = programs_for(experiment)
        report = verify_modules(
            programs.reference, programs.rank, experiment.world_size(), programs.inputs,
            programs.placements, programs.input_placements, output_placements=programs.outputs,
            numeric=experiment.verify.numeric if numeric is None else numeric,
            name=experiment.name, progress=progress, capture_workers=os.cpu_count() or 1,
            options=experiment_options(experiment, programs.fused_ops),
            executor=executor or executor_for(experiment.engine), grad=programs.grad,
            shard_fn=programs.shard_fn, assume=programs.assume)
    if patched:
        report.stats["patched"] = {
            m.name: f"{m.copy} " + (f"(lines {', '.join(map(str, m.changed_lines))} added)"
                                    if m.changed_lines else "(lines removed only)")
            for m in patched}
    return _finish(report, experiment)


def _limits(experiment: Experiment) -> WindowLimits:
    options = experiment.verify
    return WindowLimits(options.window_nodes, options.window_seconds, options.window_search_nodes,
                        options.window_settle_nodes, options.window_escalate_nodes)


def experiment_options(experiment: Experiment, fused_ops: int = 0) -> VerifyOptions:
    """The verifier options an experiment's `verify` and `plan` sections ask for."""
    checks = experiment.verify
    return VerifyOptions(window_depth=checks.window_depth, memo=checks.memo,
                         memo_store=checks.memo_store, rank_symmetry=checks.rank_symmetry,
                         context_parallel=experiment.plan.context_parallel > 1,
                         fused_ops=fused_ops, limits=_limits(experiment),
                         deadline=_deadline(experiment))


def _deadline(experiment: Experiment) -> float | None:
    """When the run's time budget ends, counted from now (the run's start)."""
    budget = experiment.verify.time_budget_s
    return None if budget is None else time.time() + budget


def _finish(report: Report, experiment: Experiment) -> Report:
    """The report with its config, logged to MLflow when the experiment asks."""
    report.config = experiment.to_dict()
    if experiment.tracking.enabled:
        from .tracking import log_run

        report.stats["mlflow_run_id"] = log_run(report, experiment.tracking)
    return report


def _verify_hlo_experiment(experiment: Experiment, **options: Any) -> Report:
    """An experiment's `hlo` section: its HLO files, or its JAX builder's dump."""
    hlo, checks = experiment.hlo, experiment.verify
    options |= {"name": experiment.name, "options": VerifyOptions(
        narrow_first=True, congruence=True, window_depth=checks.window_depth, memo=checks.memo,
        memo_store=checks.memo_store, rank_symmetry=checks.rank_symmetry,
        limits=_limits(experiment), deadline=_deadline(experiment))}
    outputs = list(hlo.outputs) if hlo.outputs else None
    if hlo.jax is None:
        return verify_hlo(hlo.reference, hlo.distributed, hlo.world_size, outputs, **options)
    return verify_jax(hlo.jax, world_size=hlo.world_size, **options)


def _named(example_inputs: dict[str, torch.Tensor] | tuple) -> dict[str, torch.Tensor]:
    if isinstance(example_inputs, dict):
        return dict(example_inputs)
    return {f"arg{i}": t for i, t in enumerate(example_inputs)}


def _call(module: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    if all(name.startswith("arg") for name in inputs):
        return module(*inputs.values())
    return module(**inputs)


def _local_inputs(inputs: dict[str, torch.Tensor], placements: dict[str, Placement], rank: int,
                  world_size: int) -> dict[str, torch.Tensor]:
    """Each rank's view of the inputs: whole, its chunk for Shard placements, or its pieces
    for Custom ones."""
    local = {}
    for name, tensor in inputs.items():
        placement = placements.get(name, Replicate())
        if isinstance(placement, Shard):
            tensor = torch.chunk(tensor, world_size, placement.dim)[placement.chunks(world_size)[rank]]
        elif isinstance(placement, Custom):  # the rank's pieces, in their local order
            pieces = sorted((p for p in placement.pieces if p.rank == rank and p.local == name),
                            key=lambda p: p.local_start)
            tensor = torch.cat([tensor.narrow(placement.dim, p.ref_start, p.size) for p in pieces],
                               placement.dim)
        local[name] = tensor.clone() if not tensor.is_meta else torch.empty_like(tensor)
    return local


def verify_hlo(reference_path: str | os.PathLike, distributed_path: str | os.PathLike,
               world_size: int, output_placements: list[Placement] | None = None, *,
               input_placements: list[Placement] | None = None, numeric: bool = False,
               name: str | None = None, progress: Progress = _quiet,
               options: VerifyOptions | None = None, executor: Executor | None = None) -> Report:
    """Prove that the SPMD HLO module at `distributed_path`, run by `world_size` devices,
    computes what the single-device HLO module at `reference_path` computes.

    The input placements are inferred (capture/hlo_relations.py) unless `input_placements`
    state them, in parameter order (as JAX shardings do); `output_placements` state the
    expected placements of the first outputs (the others are not checked; default: every
    output's, inferred from its shapes). `options`
    default to congruence and one-hop windows first: every device runs the reference's op
    structure."""
    start = time.perf_counter()
    reference = parse_module(Path(reference_path).read_text())
    distributed = parse_module(Path(distributed_path).read_text())
    ref_graph = lower_module(reference)
    names = match_inputs(reference, distributed)
    rank_graphs = [rename_inputs(lower_module(distributed, device, world_size), names)
                   for device in range(world_size)]
    timings = {"capture_s": time.perf_counter() - start}
    start = time.perf_counter()
    placements = (_by_parameter(reference, input_placements) if input_placements is not None
                  else infer_hlo_placements(ref_graph, rank_graphs[0], world_size))
    outputs = output_placements or infer_output_placements(ref_graph, rank_graphs[0], world_size)
    return verify_graphs(ref_graph, rank_graphs, placements, outputs, numeric=numeric,
                         options=options or VerifyOptions(narrow_first=True, congruence=True),
                         name=name or f"{Path(reference_path).parent.name} vs "
                                      f"{Path(distributed_path).parent.name}",
                         progress=progress, executor=executor, timings=timings, started=start)


def _by_parameter(module: HloModule, placements: list[Placement]) -> dict[str, Placement]:
    """Placements stated in parameter order, keyed by the module's parameter names."""
    names = [parameter.name for parameter in module.entry_computation.parameters()]
    if len(names) != len(placements):
        raise ShapeError(f"{len(placements)} input placements for {len(names)} parameters")
    return dict(zip(names, placements))


def verify_jax(builder: str, *, world_size: int | None = None, numeric: bool = False,
               name: str | None = None, progress: Progress = _quiet,
               options: VerifyOptions | None = None, executor: Executor | None = None) -> Report:
    """Prove that a JAX program's distributed version computes what its reference computes:
    `builder` ("module.path:function") returns a `JaxProgram`; both are dumped as HLO in a child
    process (capture/jax_dump.py) and verified with the placements their shardings state.
    `world_size`, when given, must be the number of devices the program's mesh has."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scalify-jax-") as folder:
        (dump,) = dump_jax([builder], folder)
        if world_size is not None and dump.world_size != world_size:
            raise CaptureError(f"{builder} runs on {dump.world_size} devices, not {world_size}")
        return verify_dump(dump, numeric=numeric, name=name or builder, progress=progress,
                           options=options, executor=executor,
                           dumped_s=time.perf_counter() - start)


def verify_dump(dump: JaxDump, *, dumped_s: float = 0.0, **options: Any) -> Report:
    """`verify_hlo` on a JAX dump, with the placements its shardings state; `dumped_s`, the
    time the dump took, is counted as capture."""
    report = verify_hlo(dump.reference, dump.distributed, dump.world_size, dump.outputs,
                        input_placements=dump.inputs, **options)
    report.timings["capture_s"] += dumped_s
    report.timings["total_s"] += dumped_s
    return report
