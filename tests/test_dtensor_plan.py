"""DTensor plans in configs: how a plan is written, what it means, and how mistakes are reported."""
from __future__ import annotations

import pytest

from scalify.config import load_experiment
from scalify.dtensor_plan import HF_STYLES, DTensorPlan, PlanError, StyleSpec, parse_plan
from scalify.errors import ConfigError
from scalify.placements import Replicate, Shard


def dtensor(plan, **fields) -> dict:
    return {"model": "llama-tiny", "hardware": "gpu-2",
            "plan": {"style": "dtensor", "tensor_parallel": 2, "dtensor_plan": plan, **fields}}


def test_hf_names_huggingfaces_own_plan() -> None:
    assert parse_plan("hf") == DTensorPlan(hf=True)


def test_a_style_is_a_torch_class_or_an_hf_name_with_options() -> None:
    plan = parse_plan({
        "model.layers.*.mlp.up_proj": "colwise",
        "model.norm": "SequenceParallel",
        "lm_head": {"style": "ColwiseParallel", "input_layouts": "Shard(1)",
                    "output_layouts": "replicate", "use_local_output": False},
        "model.layers.*.mlp": {"style": "PrepareModuleInput", "input_layouts": ["shard(1)", None],
                               "desired_input_layouts": ["replicate", None]},
        "model.layers.*.self_attn": {"style": "PrepareModuleInput",
                                     "input_kwarg_layouts": {"hidden_states": "shard(1)"}},
    })
    entries = dict(plan.entries)
    assert entries["model.layers.*.mlp.up_proj"] == HF_STYLES["colwise"]
    assert entries["model.norm"] == StyleSpec("SequenceParallel")
    assert entries["lm_head"].option("input_layouts") == Shard(1)
    assert entries["lm_head"].option("output_layouts") == Replicate()
    assert entries["lm_head"].option("use_local_output") is False
    assert entries["model.layers.*.mlp"].option("input_layouts") == (Shard(1), None)
    assert entries["model.layers.*.self_attn"].option("input_kwarg_layouts") == (
        ("hidden_states", Shard(1)),)


def test_an_hf_style_name_takes_options_over_its_defaults() -> None:
    spec = parse_plan({"o": {"style": "rowwise", "output_layouts": "shard(1)"}}).entries[0][1]
    assert (spec.style, spec.option("input_layouts"), spec.option("output_layouts")) == (
        "RowwiseParallel", Shard(-1), Shard(1))


@pytest.mark.parametrize("value,path,problem", [
    ({"q": "columnwise"}, ("q",), "expected a parallel style (ColwiseParallel, "),
    ({"q": {"style": "ColwiseParallel", "sequence_dim": 1}}, ("q", "sequence_dim"),
     "unknown option of ColwiseParallel (expected one of: input_layouts, output_layouts, "),
    ({"q": {"style": "colwise", "output_layouts": "shard"}}, ("q", "output_layouts"),
     "expected a layout: replicate, shard(<dim>) or null, got 'shard'"),
    ({"q": {"style": "colwise", "use_local_output": "yes"}}, ("q", "use_local_output"),
     "expected true or false, got 'yes'"),
    ({"m": {"style": "PrepareModuleInput", "input_layouts": ["shard(1)", "partial"]}},
     ("m", "input_layouts", "1"), "expected a layout"),
    ({}, (), "expected 'hf' or a mapping from module-name glob to style"),
])
def test_plan_mistakes_name_the_entry_and_option(value, path, problem) -> None:
    with pytest.raises(PlanError) as info:
        parse_plan(value)
    assert info.value.path == path and info.value.problem.startswith(problem)


def test_a_dtensor_plan_loads_from_a_shipped_plan_file() -> None:
    experiment = load_experiment({"model": "llama-tiny", "plan": "dtensor-sp-tp2",
                                  "hardware": "gpu-2"})
    entries = dict(experiment.plan.dtensor_plan.entries)
    assert experiment.plan.style == "dtensor"
    assert entries["model.layers.*.input_layernorm"] == StyleSpec("SequenceParallel")


@pytest.mark.parametrize("config,message", [
    (dtensor({"model.norm": "sequence"}),
     "<dict>: plan.dtensor_plan.model.norm: expected a parallel style"),
    (dtensor({"lm_head": {"style": "colwise", "output_layouts": "all"}}),
     "<dict>: plan.dtensor_plan.lm_head.output_layouts: expected a layout"),
    (dtensor("hf", logits="gathered"),
     "<dict>: plan.logits: not used with style dtensor: the dtensor_plan's lm_head entry decides"),
    ({"model": "llama-tiny", "hardware": "gpu-2", "plan": {"style": "dtensor", "tensor_parallel": 2}},
     "<dict>: plan.dtensor_plan: missing required key for style dtensor"),
    ({"model": "llama-tiny", "hardware": "gpu-2",
      "plan": {"style": "megatron", "tensor_parallel": 2, "dtensor_plan": "hf"}},
     "<dict>: plan.dtensor_plan: only used with style dtensor, not 'megatron'"),
])
def test_config_errors_are_one_line_and_name_the_field(config, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_experiment(config)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
