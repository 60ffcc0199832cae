"""A correct configuration captured once: the reference graph, the rank graphs and what
relates them, ready to be mutated and re-verified."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..api import capture_modules, experiment_options
from ..capture.shard_fn import stated_placements
from ..config import Experiment, load_experiment
from ..ir.graph import Graph
from ..placements import Placement, Replicate
from ..programs import programs_for
from ..verify.verifier import VerifyOptions


@dataclass
class Subject:
    """Captured graphs of one experiment, with its placements and verifier options."""

    name: str
    reference: Graph
    ranks: list[Graph]
    placements: dict[str, Placement]
    outputs: list[Placement]
    options: VerifyOptions


def capture_subject(config: str | os.PathLike | dict | Experiment) -> Subject:
    """Capture a module experiment's reference and rank graphs, as `scalify.verify` does."""
    experiment = config if isinstance(config, Experiment) else load_experiment(config)
    programs = programs_for(experiment)
    world = experiment.world_size()
    inputs = dict(programs.input_placements or {})
    reference, ranks = capture_modules(programs.reference, programs.rank, world, programs.inputs,
                                       inputs, capture_workers=os.cpu_count() or 1,
                                       grad=programs.grad)
    placements = {**stated_placements(programs.reference, world, programs.placements,
                                      programs.shard_fn), **inputs}
    outputs = programs.outputs or [Replicate()] * len(reference.outputs)
    return Subject(experiment.name, reference, ranks, placements, outputs,
                   experiment_options(experiment, programs.fused_ops))
