"""DTensor plans applied to HuggingFace models: styles, HF's own plan, placements, planted bugs."""
from __future__ import annotations

import functools

import pytest
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, SequenceParallel

from scalify.capture.ranks import fake_process_group
from scalify.dtensor_plan import DTensorPlan, parse_plan
from scalify.errors import ConfigError
from scalify.models import PRESETS, build_reference, make_hf_config
from scalify.parallel.dtensor import (build_dtensor_rank, dtensor_placements, dtensor_subject,
                                      hf_plan, logits_placement, model_plan, torch_style)
from scalify.placements import Replicate, Shard

HF = DTensorPlan(hf=True)


@functools.cache
def tiny_config():
    return make_hf_config("llama", {**PRESETS["llama-tiny"].config, "num_hidden_layers": 1})


def test_plan_entries_become_torch_styles_with_their_options() -> None:
    plan = dict(parse_plan({
        "lm_head": {"style": "ColwiseParallel", "input_layouts": "shard(1)",
                    "output_layouts": "replicate", "use_local_output": False},
        "model.norm": "sequence_parallel",
        "model.layers.*.mlp": {"style": "PrepareModuleInput", "input_layouts": ["shard(1)"],
                               "desired_input_layouts": ["replicate"]},
    }).entries)
    lm_head = torch_style(plan["lm_head"])
    assert isinstance(lm_head, ColwiseParallel) and not lm_head.use_local_output
    assert (lm_head.input_layouts, lm_head.output_layouts) == ((TorchShard(1),), (TorchReplicate(),))
    assert isinstance(torch_style(plan["model.norm"]), SequenceParallel)
    prepare = torch_style(plan["model.layers.*.mlp"])
    assert isinstance(prepare, PrepareModuleInput)
    assert (prepare.input_layouts, prepare.desired_input_layouts) == ((TorchShard(1),), (TorchReplicate(),))


def test_hf_plan_is_the_models_own_tp_plan() -> None:
    plan = hf_plan(build_reference("llama", tiny_config()))
    assert plan["model.layers.*.self_attn.q_proj"].style == "ColwiseParallel"
    assert plan["model.layers.*.mlp.down_proj"].style == "RowwiseParallel"
    assert plan["model.embed_tokens"].option("input_layouts") == Replicate()  # embedding_rowwise
    assert logits_placement(plan) == Replicate()  # colwise_gather_output


def test_vocab_parallel_logits_follow_a_colwise_lm_head() -> None:
    assert logits_placement(dict(parse_plan({"lm_head": "colwise"}).entries)) == Shard(-1)


def test_a_plan_entry_that_matches_no_module_is_an_error() -> None:
    model = build_reference("llama", tiny_config())
    with pytest.raises(ConfigError, match="'model.layers.*.attn.q_proj' matches no module"):
        model_plan(model, parse_plan({"model.layers.*.attn.q_proj": "colwise"}))


def test_placements_are_read_from_the_parallelised_parameters() -> None:
    with fake_process_group(0, 2):
        model = build_dtensor_rank("llama", tiny_config(), HF, 2)
        placements = dtensor_placements(model)
        local = model.model.layers[0].self_attn.o_proj.weight.to_local()
    assert placements["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert placements["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
    assert placements["model.embed_tokens.weight"] == Shard(0)
    assert placements["model.norm.weight"] == Replicate()
    assert tuple(local.shape) == (64, 32)


def test_a_planted_bug_must_exist_for_dtensor_plans() -> None:
    with pytest.raises(ConfigError, match="unknown planted bug 'missing-allreduce' for style dtensor"):
        dtensor_subject("llama", tiny_config(), HF, 2, planted_bug="missing-allreduce")


def test_the_norm_bug_needs_a_sequence_parallel_plan() -> None:
    with fake_process_group(0, 2), pytest.raises(ConfigError, match="needs a plan with"):
        build_dtensor_rank("llama", tiny_config(), HF, 2, "dtensor-norm-not-sequence-parallel")
