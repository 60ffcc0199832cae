"""Tensor-parallel rank modules: built on meta, run under a fake process group, named and shaped like HF."""
from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig

import scalify.parallel
from scalify.errors import ConfigError, ShapeError
from scalify.models import PRESETS, build_reference, example_inputs, make_hf_config, reference_forward
from scalify.parallel import PLANTED_BUGS, build_rank_model, param_placements
from scalify.parallel.context_planted import CONTEXT_PLANTED
from scalify.parallel.dtensor_planted import DTENSOR_PLANTED_BUGS
from scalify.parallel.experts_planted import EXPERT_PARALLEL_BUGS
from scalify.parallel.planted import (DATA_PARALLEL_BUGS, PIPELINE_BUGS, PLANTED_PARTS,
                                      PLANTED_QKV_ROWS)
from scalify.placements import Placement, Replicate, Shard

LAYER_FIELD = {"llama": "num_hidden_layers", "gpt2": "n_layer"}
BATCH, SEQ = 2, 5


@functools.cache
def hf_config(preset_name: str, **overrides):
    preset = PRESETS[preset_name]
    return make_hf_config(preset.family, {**preset.config, **overrides})


@functools.cache
def reference(preset_name: str, **overrides) -> nn.Module:
    return build_reference(PRESETS[preset_name].family, hf_config(preset_name, **overrides))


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group: collectives run (on meta) without communicating."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_rank(preset_name: str, rank: int, world_size: int, **kwargs) -> tuple[nn.Module, torch.Tensor]:
    family = PRESETS[preset_name].family
    with fake_world(rank, world_size):
        model = build_rank_model(family, hf_config(preset_name), rank, world_size, **kwargs)
        logits = model(**example_inputs(family, BATCH, SEQ))
    return model, logits


def cut(shape: torch.Size, placement: Placement, world_size: int) -> tuple[int, ...]:
    """The local shape a rank holds of a reference tensor of `shape`."""
    local = list(shape)
    if isinstance(placement, Shard):
        chunks = len(set(placement.chunks(world_size)))
        assert local[placement.dim] % chunks == 0
        local[placement.dim] //= chunks
    return tuple(local)


def reference_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by name, tied aliases included."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


TINY = ["llama-tiny", "llama-tiny-gqa", "gpt2-tiny"]
CASES = [(preset, n) for preset in TINY for n in (1, 2, 4, 8)]


@pytest.mark.parametrize("preset_name, world_size", CASES)
def test_every_rank_runs_and_returns_logits(preset_name, world_size):
    vocab = hf_config(preset_name).vocab_size
    for rank in range(world_size):
        _, gathered = run_rank(preset_name, rank, world_size)
        _, local = run_rank(preset_name, rank, world_size, logits="vocab_parallel")
        assert gathered.shape == (BATCH, SEQ, vocab)
        assert local.shape == (BATCH, SEQ, vocab // world_size)
        assert gathered.device.type == "meta" and gathered.dtype == torch.float32


@pytest.mark.parametrize("preset_name, world_size", CASES)
def test_names_equal_the_reference_and_shapes_are_cut_by_placements(preset_name, world_size):
    family = PRESETS[preset_name].family
    ref = reference(preset_name)
    placements = param_placements(family, hf_config(preset_name), world_size)
    assert set(placements) == set(reference_tensors(ref))
    for rank in range(world_size):
        model, _ = run_rank(preset_name, rank, world_size)
        assert [name for name, _ in model.named_parameters()] == [name for name, _ in ref.named_parameters()]
        assert [name for name, _ in model.named_buffers()] == [name for name, _ in ref.named_buffers()]
        for name, tensor in reference_tensors(model).items():
            reference_shape = reference_tensors(ref)[name].shape
            assert tuple(tensor.shape) == cut(reference_shape, placements[name], world_size), name


def test_llama_8b_one_layer_runs_on_eight_ranks():
    config = hf_config("llama-3.1-8b", num_hidden_layers=1)
    placements = param_placements("llama", config, 8)
    ref = dict(reference_tensors(reference("llama-3.1-8b", num_hidden_layers=1)))
    with fake_world(5, 8):
        model = build_rank_model("llama", config, 5, 8)
        logits = model(**example_inputs("llama", 1, 4))
    assert logits.shape == (1, 4, 128256)
    for name, tensor in reference_tensors(model).items():
        assert tuple(tensor.shape) == cut(ref[name].shape, placements[name], 8), name


def test_megatron_placements():
    llama = param_placements("llama", hf_config("llama-tiny"), 2)
    assert llama["model.embed_tokens.weight"] == Shard(0)
    assert llama["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert llama["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
    assert llama["model.layers.0.mlp.down_proj.weight"] == Shard(1)
    assert llama["model.layers.0.input_layernorm.weight"] == Replicate()
    assert llama["model.rotary_emb.inv_freq"] == Replicate()
    assert llama["lm_head.weight"] == Shard(0)

    gpt2 = param_placements("gpt2", hf_config("gpt2-tiny"), 2)
    assert gpt2["transformer.h.0.attn.c_attn.weight"] == Shard(1, blocks=3)
    assert gpt2["transformer.h.0.attn.c_attn.bias"] == Shard(0, blocks=3)
    assert gpt2["transformer.h.0.attn.c_proj.weight"] == Shard(0)
    assert gpt2["transformer.h.0.attn.c_proj.bias"] == Replicate()
    assert gpt2["transformer.h.0.mlp.c_fc.weight"] == Shard(1)
    assert gpt2["transformer.wte.weight"] == gpt2["lm_head.weight"] == Shard(0)
    assert gpt2["transformer.wpe.weight"] == Replicate()


def test_gqa_kv_heads_split_or_replicated():
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert param_placements("llama", hf_config("llama-tiny-gqa"), 2)[k_proj] == Shard(0)
    assert param_placements("llama", hf_config("llama-tiny-gqa"), 4)[k_proj] == Shard(0, chunk_of_rank=(0, 0, 1, 1))
    wrong = param_placements("llama", hf_config("llama-tiny-gqa"), 4, planted_bug="gqa-wrong-kv-head")
    assert wrong[k_proj] == Shard(0, chunk_of_rank=(0, 1, 0, 1))


@pytest.mark.parametrize(
    "preset_name, overrides, world_size, field",
    [
        ("gpt2", {}, 2, "vocab_size"),
        ("llama-tiny", {}, 16, "num_attention_heads"),
        ("llama-tiny", {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 100}, 8,
         "intermediate_size"),
        ("llama-tiny", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, 4,
         "num_key_value_heads"),
    ],
)
def test_uneven_shapes_are_shape_errors(preset_name, overrides, world_size, field):
    family = PRESETS[preset_name].family
    with pytest.raises(ShapeError, match=field):
        build_rank_model(family, hf_config(preset_name, **overrides), 0, world_size)


def test_bad_arguments_are_config_errors():
    llama = hf_config("llama-tiny")
    with pytest.raises(ConfigError, match="unknown model family"):
        build_rank_model("mamba", llama, 0, 2)
    with pytest.raises(ConfigError, match="unknown planted bug"):
        build_rank_model("llama", llama, 0, 2, planted_bug="typo")
    with pytest.raises(ConfigError, match="not 'gpt2'"):
        build_rank_model("gpt2", hf_config("gpt2-tiny"), 0, 2, planted_bug="missing-allreduce")
    with pytest.raises(ConfigError, match="logits"):
        build_rank_model("llama", llama, 0, 2, logits="scattered")
    with pytest.raises(ConfigError, match="rank 2"):
        build_rank_model("llama", llama, 2, 2)
    with pytest.raises(ConfigError, match="eager"):
        build_rank_model("llama", LlamaConfig(**PRESETS["llama-tiny"].config), 0, 2)


BUG_CASES = [(bug, family) for bug, by_family in PLANTED_PARTS.items() for family in by_family]
TINY_OF = {"llama": "llama-tiny-gqa", "gpt2": "gpt2-tiny"}


@pytest.mark.parametrize("bug, family", BUG_CASES)
def test_planted_bug_builds_runs_and_keeps_names_and_placed_shapes(bug, family):
    preset_name, world_size = TINY_OF[family], 4
    ref = reference_tensors(reference(preset_name))
    placements = param_placements(family, hf_config(preset_name), world_size, planted_bug=bug)
    for rank in range(world_size):
        model, logits = run_rank(preset_name, rank, world_size, planted_bug=bug)
        assert logits.shape == (BATCH, SEQ, hf_config(preset_name).vocab_size)
        local = reference_tensors(model)
        assert set(local) == set(ref)
        for name, tensor in local.items():
            assert tuple(tensor.shape) == cut(ref[name].shape, placements[name], world_size), name


def test_column_wrong_dim_declares_the_dim_1_shard():
    placements = param_placements("llama", hf_config("llama-tiny"), 2, planted_bug="column-wrong-dim")
    assert placements["model.layers.0.self_attn.q_proj.weight"] == Shard(1)


def test_each_planted_bug_is_marked_on_exactly_one_line():
    sources = "\n".join(path.read_text() for path in Path(scalify.parallel.__file__).parent.glob("*.py"))
    markers = re.findall(r"# planted: ([\w-]+)", sources)
    assert sorted(markers) == sorted([*PLANTED_BUGS, *DTENSOR_PLANTED_BUGS, *EXPERT_PARALLEL_BUGS,
                                      *CONTEXT_PLANTED])
    assert set(PLANTED_PARTS) | set(PLANTED_QKV_ROWS) == \
        set(PLANTED_BUGS) - set(DATA_PARALLEL_BUGS) - set(PIPELINE_BUGS)


class Logits(nn.Module):
    """Exportable wrapper around a reference model's logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return reference_forward(self.model)(input_ids, attention_mask)


def exported_ops(model: nn.Module, family: str) -> list[str]:
    program = torch.export.export(model, (), example_inputs(family, BATCH, SEQ), strict=False)
    return [str(node.target) for node in program.graph.nodes if node.op == "call_function"]


# What tensor parallelism adds to HF's op sequence: the embedding mask, collectives, the gather's
# chunk+cat, and (GPT-2) a row-parallel Conv1D's addmm split into mm, all_reduce, add.
TP_OPS = {
    "aten.lt.Scalar", "aten.ge.Scalar", "aten.__or__.Tensor", "aten.sub.Tensor", "aten.masked_fill.Scalar",
    "aten.unsqueeze.default", "aten.mm.default", "aten.add.Tensor", "aten.chunk.default", "aten.cat.default",
    "<built-in function getitem>", "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.wait_tensor.default",
    "aten.view_as.default",  # Megatron's copy-to-region: an identity autograd function
}


@pytest.mark.parametrize("preset_name", ["llama-tiny-gqa", "gpt2-tiny"])
def test_rank_program_is_hf_program_plus_collectives(preset_name):
    family = PRESETS[preset_name].family
    overrides = {LAYER_FIELD[family]: 1}
    reference_ops = exported_ops(Logits(reference(preset_name, **overrides)), family)
    with fake_world(1, 2):
        rank_ops = exported_ops(build_rank_model(family, hf_config(preset_name, **overrides), 1, 2), family)

    matcher = difflib.SequenceMatcher(a=reference_ops, b=rank_ops, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            assert set(reference_ops[i1:i2]) <= {"aten.addmm.default"}, (tag, reference_ops[i1:i2])
            assert set(rank_ops[j1:j2]) <= TP_OPS, (tag, rank_ops[j1:j2])
