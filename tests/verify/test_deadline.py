"""A run given a deadline reports what it found by then: the ops not yet proved are unknown
(never verified), and a discrepancy found before the deadline stands."""
import dataclasses
import time
import types

import torch

import scalify
from scalify.verify import verifier as verifier_module
from scalify.api import experiment_options
from scalify.config import REPO_CONFIGS, load_experiment
from scalify.verify.verifier import Verifier, VerifyOptions

from .test_verify_modules import HIDDEN, MLP, WORLD, ParallelMLP


class Squashed(MLP):
    def forward(self, x):
        return torch.tanh(super().forward(x))


class SquashedParallel(ParallelMLP):
    def forward(self, x):
        return torch.tanh(super().forward(x))


def _verify(reduce: bool, deadline: float | None) -> scalify.Report:
    return scalify.verify_modules(
        reference=Squashed(), rank_module_factory=lambda rank: SquashedParallel(reduce).to("meta"),
        world_size=WORLD, example_inputs={"x": torch.randn(2, 4, HIDDEN)},
        param_placements={"up.weight": scalify.Shard(0), "down.weight": scalify.Shard(1)},
        output_placements=[scalify.Replicate()], options=VerifyOptions(deadline=deadline))


def test_a_run_whose_deadline_passed_is_unknown_not_verified():
    assert _verify(reduce=True, deadline=time.time() + 3600).verdict == "verified"
    report = _verify(reduce=True, deadline=time.time() - 1)
    assert report.verdict == "unknown"
    assert any("deadline passed" in reason for reason in report.unknown)


def test_a_discrepancy_found_before_the_deadline_stands(monkeypatch):
    clock = types.SimpleNamespace(time=lambda: 0.0)
    monkeypatch.setattr(verifier_module, "time", clock)
    check_outputs = Verifier._check_outputs

    def late(self, *args):  # the deadline passes once every op was visited
        clock.time = lambda: 100.0
        return check_outputs(self, *args)

    monkeypatch.setattr(Verifier, "_check_outputs", late)
    report = _verify(reduce=False, deadline=10.0)
    assert report.verdict == "discrepancy" and report.discrepancies[0].ref_op == "tanh"
    assert any("outputs' placements: not checked" in reason for reason in report.unknown)


def test_a_budget_in_the_config_sets_the_deadline_from_the_start():
    experiment = load_experiment(REPO_CONFIGS / "experiments" / "llama-tiny-tp2.yaml")
    assert experiment_options(experiment).deadline is None
    budgeted = dataclasses.replace(experiment, verify=dataclasses.replace(
        experiment.verify, time_budget_s=90))
    assert 85 < experiment_options(budgeted).deadline - time.time() <= 90


class Scaled(torch.nn.Module):
    def __init__(self, scale: list[float]):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale), persistent=False)  # not a weight

    def forward(self, x):
        return torch.tanh(x * self.scale + 1.0)


def test_a_run_open_when_the_deadline_passed_is_the_discrepancy_when_the_numbers_differ(
        monkeypatch):
    """The rank scales by other constants: the mul begins a run of ops the ranks might compute
    fused, and the deadline passes before a later op ends it; the numbers differ, so the run's
    first op is reported."""
    clock = types.SimpleNamespace(time=lambda: 0.0)
    monkeypatch.setattr(verifier_module, "time", clock)
    infer = Verifier._infer

    def late(self, node, relations, result):
        relation = infer(self, node, relations, result)
        if relation is not None and relation.pending is not None:
            clock.time = lambda: 100.0  # the deadline passes once a run is open
        return relation

    monkeypatch.setattr(Verifier, "_infer", late)
    report = scalify.verify_modules(
        reference=Scaled([1.0, 2.0, 3.0, 4.0]),
        rank_module_factory=lambda rank: Scaled([4.0, 3.0, 2.0, 1.0]),
        world_size=WORLD, example_inputs={"x": torch.randn(2, 4)},
        output_placements=[scalify.Replicate()], numeric=True,
        options=VerifyOptions(deadline=10.0))
    assert report.verdict == "discrepancy" and report.discrepancies[0].ref_op == "mul"
    assert "deadline passed before a later op" in report.discrepancies[0].hint
