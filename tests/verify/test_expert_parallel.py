"""Expert parallelism verified through the modules API (the matrix covers the experiment path)."""
from __future__ import annotations

from scalify import verify_modules
from scalify.models import PRESETS, build_reference, example_inputs, make_hf_config
from scalify.parallel.experts import expert_parallel_rank, expert_placements
from scalify.steps import Step, hf_logits


def test_expert_parallel_mixtral_verifies_and_the_numbers_agree():
    config = make_hf_config("mixtral", {**PRESETS["mixtral-tiny"].config, "num_hidden_layers": 1})
    report = verify_modules(
        Step(build_reference("mixtral", config), hf_logits),
        lambda rank: Step(expert_parallel_rank(config, rank, 2), hf_logits), 2,
        example_inputs("mixtral", 1, 8), expert_placements(config, 2), numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_router_gradient_left_partial_is_caught_at_the_router_in_the_training_step():
    """The bug changes no forward value; the training step shows the router's gradient is a
    partial sum (the missing all-reduce is no op, so the report names where it is consumed)."""
    from scalify import verify
    from scalify.matrix import Cell

    cell = Cell("mixtral", "EP2", True, (("expert_parallel", 2),), bug="ep-router-grad-unreduced")
    report = verify(cell.experiment(), numeric=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    first = report.discrepancies[0]
    assert first.dist_source.backward and "modeling_mixtral.py" in first.dist_source.file
    assert "all_reduce is missing" in first.hint
    forward = verify({**cell.experiment(), "verify": {"backward": False}}, numeric=True)
    assert forward.verdict == "verified"
