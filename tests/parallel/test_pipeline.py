"""Pipeline parallelism: stage blocks, HF-named stage parameters, placements, plan validation,
and the dropped-layer bug reported at its stage boundary."""
import pytest

import scalify
from scalify.config import load_experiment
from scalify.errors import ConfigError
from scalify.matrix import planted_line
from scalify.models import build_reference, make_hf_config
from scalify.parallel.pipeline import PipelineSchedule, stage_model, stage_placements
from scalify.placements import Stage

NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight",
         "model.norm.weight", "lm_head.weight")


def _experiment(**plan) -> dict:
    stages = plan.get("pipeline_parallel", 2) * plan.get("tensor_parallel", 1)
    return {"name": "pp", "model": "llama-tiny",
            "plan": {"tensor_parallel": 1, "pipeline_parallel": 2, **plan},
            "hardware": {"name": "gpu", "target": "gpu", "devices": stages},
            "inputs": {"batch": 2, "seq": 8}}


def test_stages_hold_contiguous_blocks():
    blocks = [PipelineSchedule(NAMES, 0, 2, 3).block(s) for s in range(2)]
    assert [list(block) for block in blocks] == [[0], [1, 2]]


def test_placements_put_each_parameter_on_its_stage():
    placements = stage_placements(PipelineSchedule(NAMES, 0, 2, 3))
    assert placements["model.embed_tokens.weight"] == Stage(0)
    assert placements["model.layers.0.mlp.up_proj.weight"] == Stage(0)
    assert placements["model.layers.2.mlp.up_proj.weight"] == Stage(1)
    assert placements["lm_head.weight"] == Stage(1)


def test_a_stage_module_keeps_hf_names_of_what_it_holds():
    model = build_reference("llama", make_hf_config("llama", {"num_hidden_layers": 2}))
    stage = stage_model(model, PipelineSchedule(NAMES, 1, 2, 2).block(1), first=False, last=True)
    names = {name for name, _ in stage.named_parameters()}
    assert "model.layers.1.mlp.up_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.embed_tokens.")) for n in names)


def test_pipeline_world_size_and_validation():
    assert load_experiment(_experiment(micro_batches=2)).world_size() == 2
    with pytest.raises(ConfigError, match="plan.pipeline_parallel.*tensor, data or expert parallelism"):
        load_experiment(_experiment(tensor_parallel=2))
    with pytest.raises(ConfigError, match="plan.pipeline_parallel.*at least as many decoder layers"):
        load_experiment({**_experiment(pipeline_parallel=4), "hardware": {
            "name": "gpu", "target": "gpu", "devices": 4}})


def test_a_dropped_layer_names_its_parameter_and_the_stage_boundary():
    file, line = planted_line("pp-stage-boundary-dropped")
    with pytest.raises(ConfigError, match=rf"model\.layers\.1\..*held by no pipeline stage.*"
                                          rf"{file}:{line}"):
        scalify.verify({**_experiment(planted_bug="pp-stage-boundary-dropped"),
                        "inputs": {"batch": 1, "seq": 8}})


def test_a_missing_stage_parameter_is_a_clear_input_error():
    from scalify.verify.relations import stage_relation

    with pytest.raises(scalify.errors.ShapeError, match="w: Stage\\(1\\) says rank 1 holds it"):
        stage_relation("w", Stage(1), (2, 3), "r1/w", None)


def test_three_stages_verify_a_training_step():
    """The middle stage receives its input, sends its output on and its input's gradient back."""
    report = scalify.verify({**_experiment(pipeline_parallel=3), "inputs": {"batch": 1, "seq": 8},
                             "hardware": {"name": "gpu", "target": "gpu", "devices": 3},
                             "overrides": {"model.num_hidden_layers": 3},
                             "verify": {"backward": True}}, numeric=True)
    assert report.verdict == "verified" and report.numeric["agrees"]
    assert "Stage" in report.stats["rank_symmetry"]  # stages run different programs
