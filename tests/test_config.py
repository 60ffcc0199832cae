"""Experiment files: what loads, how overrides apply, and how each mistake is reported."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from scalify.config import (
    REPO_CONFIGS,
    EngineSpec,
    HardwareSpec,
    InputSpec,
    PlanSpec,
    TrackingSpec,
    VerifyOptions,
    load_experiment,
)
from scalify.errors import ConfigError
from scalify.models.presets import PRESETS

MINIMAL = """\
model: llama-tiny
plan: megatron-tp2
hardware: gpu-2
"""
MINIMAL_DICT = {"model": "llama-tiny", "plan": "megatron-tp2", "hardware": "gpu-2"}


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in tmp_path so error messages show short relative paths."""
    monkeypatch.chdir(tmp_path)


def write(text: str, name: str = "x.yaml", folder: str = "experiments") -> Path:
    """Write a YAML file under ./configs/<folder>/ and return its relative path."""
    path = Path("configs") / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def config_error(source: Path | dict) -> str:
    """The one-line message of the ConfigError that loading `source` raises."""
    with pytest.raises(ConfigError) as info:
        load_experiment(source)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- what loads -------------------------------------------------------------------------------


MODEL_EXPERIMENTS = [path for path in sorted((REPO_CONFIGS / "experiments").glob("*.yaml"))
                     if "hlo" not in yaml.safe_load(path.read_text())]  # HLO: test_hlo_config.py


@pytest.mark.parametrize("path", MODEL_EXPERIMENTS, ids=lambda p: p.stem)
def test_every_shipped_experiment_loads(path: Path) -> None:
    experiment = load_experiment(path)
    assert experiment.hardware.devices == experiment.world_size()
    assert experiment.model.preset in PRESETS


def test_every_preset_has_a_model_config() -> None:
    assert {path.stem for path in (REPO_CONFIGS / "models").glob("*.yaml")} == set(PRESETS)


def test_demo_cuts_llama_8b_to_four_layers() -> None:
    demo = load_experiment(REPO_CONFIGS / "experiments" / "demo.yaml")
    assert demo.name == "demo"
    assert demo.model.family == "llama"
    assert demo.model.config == {**PRESETS["llama-3.1-8b"].config, "num_hidden_layers": 4}
    assert demo.plan == PlanSpec(style="megatron", tensor_parallel=8, logits="gathered")
    assert demo.hardware == HardwareSpec(name="gpu-8", target="gpu", devices=8)
    assert demo.inputs == InputSpec(batch=1, seq=16)
    assert demo.world_size() == 8
    assert demo.to_dict()["model"]["config"]["num_hidden_layers"] == 4


def test_missing_sections_take_defaults_and_name_is_the_file_stem() -> None:
    experiment = load_experiment(write(MINIMAL, name="small.yaml"))
    assert experiment.name == "small"
    assert experiment.source == "configs/experiments/small.yaml"
    assert (experiment.inputs, experiment.verify, experiment.tracking) == (InputSpec(), VerifyOptions(), TrackingSpec())
    assert experiment.model.config == PRESETS["llama-tiny"].config


def test_overrides_set_fields_of_every_section() -> None:
    overrides = """\
overrides:
  model.num_hidden_layers: 3
  model.rms_norm_eps: 1e-6
  plan.tensor_parallel: 4
  plan.logits: vocab_parallel
  hardware.devices: 4
  inputs.seq: 32
  verify.numeric: true
  tracking.enabled: true
inputs: {seq: 8}
"""
    path = write(MINIMAL + overrides)
    experiment = load_experiment(path)
    assert experiment.model.config["num_hidden_layers"] == 3
    assert experiment.model.config["rms_norm_eps"] == 1e-6
    assert experiment.plan == PlanSpec(tensor_parallel=4, logits="vocab_parallel")
    assert experiment.hardware.devices == 4
    assert experiment.inputs.seq == 32
    assert experiment.verify.numeric and experiment.tracking.enabled


def test_engine_is_auto_by_default_and_set_like_any_section() -> None:
    assert load_experiment(MINIMAL_DICT).engine == EngineSpec(kind="auto", address=None, actors=2)
    experiment = load_experiment({**MINIMAL_DICT, "engine": {"kind": "ray", "actors": 4},
                                  "overrides": {"engine.address": "ray://head:10001"}})
    assert experiment.engine == EngineSpec(kind="ray", address="ray://head:10001", actors=4)


def test_inline_sections_and_a_dict_source_load_alike() -> None:
    data = {
        "name": "inline",
        "model": {"preset": "gpt2-tiny", "config": {"n_layer": 1}},
        "plan": {"tensor_parallel": 2},
        "hardware": {"name": "trn1-2", "target": "neuron", "devices": 2},
    }
    from_dict = load_experiment(data)
    assert from_dict.source == "<dict>"
    assert from_dict.model.family == "gpt2" and from_dict.model.config["n_layer"] == 1
    from_file = load_experiment(write(yaml.safe_dump(data)))
    assert from_file == dataclasses.replace(from_dict, source="configs/experiments/x.yaml")


def test_names_resolve_in_the_local_configs_dir_first_and_paths_next_to_the_file() -> None:
    write("family: llama\npreset: llama-tiny\nconfig: {num_hidden_layers: 5}\n", name="mine.yaml", folder="models")
    write("style: megatron\ntensor_parallel: 2\n", name="two.yaml", folder="experiments/parts")
    experiment = load_experiment(write("model: mine\nplan: parts/two.yaml\nhardware: gpu-2\n"))
    assert experiment.model.config["num_hidden_layers"] == 5
    assert experiment.plan.tensor_parallel == 2


def test_a_model_without_preset_needs_a_family_and_takes_only_given_fields() -> None:
    experiment = load_experiment({**MINIMAL_DICT, "model": {"family": "gpt2", "config": {"n_layer": 2}}})
    assert (experiment.model.preset, experiment.model.config) == (None, {"n_layer": 2})


# --- how mistakes are reported ----------------------------------------------------------------

X = "configs/experiments/x.yaml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model: llama-tiny\nplan: {tensor_parallel: eight}\nhardware: gpu-8\n",
            f"{X}: plan.tensor_parallel: expected a positive integer, got 'eight'",
        ),
        (
            "model: llama-tiny\nplan: {style: megatron_core}\nhardware: gpu-2\n",
            f"{X}: plan.megatron_core: missing required key for style megatron_core",
        ),
        (
            "model: llama-tiny\nplan: {style: megatron_core, megatron_core: "
            "{tensor_model_parallel_size: 2}, tensor_parallel: 2}\nhardware: gpu-2\n",
            f"{X}: plan.tensor_parallel: not used with style megatron_core: give the framework's own",
        ),
        (
            "model: llama-tiny\nplan: {style: megatron_core, megatron_core: "
            "{pipeline_model_parallel_size: 2}}\nhardware: gpu-2\n",
            f"{X}: plan.megatron_core.pipeline_model_parallel_size: not supported yet",
        ),
        (
            "model: llama-tiny\nplan: {style: megatron_core, megatron_core: "
            "{tensor_model_parallel_size: 2, sequence_parallel: true}}\nhardware: gpu-2\n",
            f"{X}: plan.megatron_core.sequence_parallel: not supported by Megatron-Core's local",
        ),
        (
            "model: mixtral-tiny\nplan: {style: megatron_core, megatron_core: "
            "{tensor_model_parallel_size: 2}}\nhardware: gpu-2\n",
            f"{X}: plan.style: style megatron_core builds the framework's Llama from a llama config",
        ),
        (
            "model: llama-tiny\nplan: {megatron_core: {tensor_model_parallel_size: 2}}\n"
            "hardware: gpu-2\n",
            f"{X}: plan.megatron_core: only used with style megatron_core, not 'megatron'",
        ),
        (
            "model: llama-tiny\nplan: {style: torchtitan}\nhardware: gpu-2\n",
            f"{X}: plan.torchtitan: missing required key for style torchtitan",
        ),
        (
            "model: llama-tiny\nplan: {style: torchtitan, torchtitan: {tensor_parallel_degree: 2, "
            "context_parallel_degree: 2}}\nhardware: gpu-4\n",
            f"{X}: plan.torchtitan.context_parallel_degree: not supported yet for torchtitan",
        ),
        (
            "model: llama-tiny\nplan: {style: torchtitan, torchtitan: {tensor_parallel_degree: 2, "
            "spmd_backend: full_dtensor}}\nhardware: gpu-2\n",
            f"{X}: plan.torchtitan.spmd_backend: full_dtensor is not verified yet",
        ),
        (
            "model: llama-tiny\nplan: {style: torchtitan, torchtitan: {tensor_parallel_degree: 2, "
            "spmd_backend: spmd_types}}\nhardware: gpu-2\n",
            f"{X}: plan.torchtitan.enable_sequence_parallel: not verified yet with spmd_backend",
        ),
        (
            "model: llama-tiny\nplan: {tensor_parallel: 2, patches: [fix.diff]}\nhardware: gpu-2\n",
            f"{X}: plan.patches.0: no such patch file 'fix.diff' (paths are relative to the repository",
        ),
        (
            "model: llama-tiny\nplan: {tensor_parallel: 2, patches: fix.diff}\nhardware: gpu-2\n",
            f"{X}: plan.patches: expected a list of unified diff files, got 'fix.diff'",
        ),
        (MINIMAL + "inputs: {batch: true}\n", f"{X}: inputs.batch: expected a positive integer, got True"),
        (MINIMAL + "inputs: {seq: 0}\n", f"{X}: inputs.seq: expected a positive integer, got 0"),
        (MINIMAL + "verify: {numeric: 1}\n", f"{X}: verify.numeric: expected true or false, got 1"),
        (
            MINIMAL + "verify: {numerik: true}\n",
            f"{X}: verify.numerik: unknown key (expected one of: backward, loss, memo, memo_store, numeric, rank_symmetry, time_budget_s, window_depth, window_escalate_nodes, window_nodes, window_search_nodes, window_seconds, window_settle_nodes)",
        ),
        (MINIMAL + "verify: {time_budget_s: 0}\n",
         f"{X}: verify.time_budget_s: expected a positive integer, got 0"),
        (MINIMAL + "verfy: {}\n", f"{X}: verfy: unknown key (expected one of: engine, hardware, hlo, inputs,"),
        (MINIMAL + "engine: {kind: spark}\n", f"{X}: engine.kind: expected one of: auto, inline, ray, got 'spark'"),
        (MINIMAL + "engine: {actors: 0}\n", f"{X}: engine.actors: expected a positive integer, got 0"),
        (MINIMAL + "inputs: [1, 16]\n", f"{X}: inputs: expected a mapping, got [1, 16]"),
        (
            "model: llama-tiny\nplan: {logits: all}\nhardware: gpu-1\n",
            f"{X}: plan.logits: expected one of: gathered, vocab_parallel, got 'all'",
        ),
        (
            "model: llama-tiny\nplan: megatron-tp2\nhardware: {name: h, target: tpu, devices: 2}\n",
            f"{X}: hardware.target: expected one of: gpu, neuron, got 'tpu'",
        ),
        (
            "model: llama-tiny\nplan: megatron-tp2\nhardware: {target: gpu, devices: 2}\n",
            f"{X}: hardware.name: missing required key",
        ),
        ("model: llama-tiny\nplan: megatron-tp2\n", f"{X}: hardware: missing required key"),
        (
            MINIMAL.replace("llama-tiny", "llama-9b"),
            f"{X}: model: no model config named 'llama-9b' (looked in configs/models/, ",
        ),
        (MINIMAL.replace("gpu-2", "hw/gpu-2.yaml"), f"{X}: hardware: no such file 'configs/experiments/hw/gpu-2.yaml'"),
        (
            MINIMAL + "overrides: {model.hidden_sz: 32}\n",
            f"{X}: overrides.model.hidden_sz: unknown llama config field (expected one of: attention_bias, hidden_size,",
        ),
        (
            MINIMAL + "overrides: {model.num_hidden_layers: four}\n",
            f"{X}: overrides.model.num_hidden_layers: expected a positive integer, got 'four'",
        ),
        (
            MINIMAL + "overrides: {plan.tp: 2}\n",
            f"{X}: overrides.plan.tp: unknown key (expected one of: context_load_balance, "
            "context_parallel, data_parallel, dtensor_plan, "
            "expert_dispatch, expert_parallel, fused, logits, megatron_core, micro_batches, "
            "patches, pipeline_parallel, "
            "planted_bug, sequence_parallel, shard_fn, style, tensor_parallel, torchtitan, zero_stage)",
        ),
        (
            MINIMAL + "overrides: {layers: 2}\n",
            f"{X}: overrides.layers: expected a key 'section.field' with section one of: model, plan,",
        ),
        (
            "model: {family: gpt2, preset: llama-tiny}\nplan: megatron-tp2\nhardware: gpu-2\n",
            f"{X}: model.family: preset 'llama-tiny' is a 'llama' model, not 'gpt2'",
        ),
        ("model: {config: {}}\nplan: megatron-tp2\nhardware: gpu-2\n", f"{X}: model.family: missing required key"),
        (
            "model: llama-tiny\nplan: megatron-tp8\nhardware: gpu-4\n",
            f"{REPO_CONFIGS}/hardware/gpu-4.yaml: hardware.devices: 4 devices do not match the plan's world size 8"
            " (tensor_parallel=8, data_parallel=1)",
        ),
        (MINIMAL + "name: 7\n", f"{X}: name: expected a non-empty string, got 7"),
        (MINIMAL + "overrides: {plan.fused: yes please}\n", f"{X}: overrides.plan.fused: expected true or false"),
        (
            MINIMAL + "overrides: {plan.shard_fn: my_converter.shard}\n",
            f"{X}: overrides.plan.shard_fn: expected 'module.path:function', got 'my_converter.shard'",
        ),
        (
            "model: gpt2-tiny\nplan: {tensor_parallel: 2, fused: true}\nhardware: gpu-2\n",
            f"{X}: plan.fused: fused layouts exist for llama, not 'gpt2'",
        ),
        (
            "model: llama-tiny\nplan: {expert_parallel: 2}\nhardware: gpu-2\n",
            f"{X}: plan.expert_parallel: expert parallelism needs a MoE model (mixtral), not 'llama'",
        ),
        (
            "model: mixtral-tiny\nplan: {expert_parallel: 2, tensor_parallel: 2}\nhardware: gpu-4\n",
            f"{X}: plan.expert_parallel: expert parallelism combined with tensor or data parallelism",
        ),
        (
            "model: mixtral-tiny\nplan: {expert_parallel: 3}\nhardware: {name: g, target: gpu, devices: 3}\n",
            f"{X}: plan.expert_parallel: 4 experts (num_local_experts) do not split evenly over 3 ranks",
        ),
        (
            "model: mixtral-tiny\nplan: {expert_dispatch: all_to_all}\nhardware: gpu-1\n",
            f"{X}: plan.expert_dispatch: only used with expert_parallel > 1",
        ),
        ("model: llama-tiny\nplan: [megatron\n", f"{X}:3: malformed YAML: "),
        ("- model\n- plan\n", f"{X}: expected a mapping, got ['model', 'plan']"),
        ("", f"{X}: expected a mapping, got None"),
    ],
)
def test_each_mistake_names_its_file_and_field(text: str, expected: str) -> None:
    assert config_error(write(text)).startswith(expected)


def test_an_error_in_a_referenced_file_names_that_file() -> None:
    write("style: megatron\ntensor_parallel: 0\n", name="bad.yaml", folder="plans")
    message = config_error(write("model: llama-tiny\nplan: bad\nhardware: gpu-2\n"))
    assert message == "configs/plans/bad.yaml: plan.tensor_parallel: expected a positive integer, got 0"


def test_an_unknown_hf_field_in_a_model_file_names_that_file() -> None:
    write("preset: gpt2-tiny\nconfig: {hidden_size: 64}\n", name="odd.yaml", folder="models")
    message = config_error(write("model: odd\nplan: megatron-tp2\nhardware: gpu-2\n"))
    assert message.startswith("configs/models/odd.yaml: model.config.hidden_size: unknown gpt2 config field")


def test_a_dict_source_reports_dict() -> None:
    message = config_error({**MINIMAL_DICT, "inputs": {"seq": -1}})
    assert message == "<dict>: inputs.seq: expected a positive integer, got -1"


def test_a_file_over_one_megabyte_is_refused() -> None:
    path = write(MINIMAL + "#" * (1 << 20))
    assert config_error(path) == f"{X}: file is larger than 1048576 bytes"


def test_a_yaml_bomb_fails_fast_with_a_short_message() -> None:
    levels = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    path = write(MINIMAL + "verify:\n  numeric:\n" + "".join(f"    - {level}\n" for level in levels))
    message = config_error(path)
    assert message.startswith(f"{X}: verify.numeric: expected true or false, got [[") and len(message) < 300


def test_deep_nesting_is_malformed_yaml() -> None:
    message = config_error(write("model: " + "[" * 100_000 + "]" * 100_000 + "\n"))
    assert message.startswith(f"{X}: malformed YAML")
