"""Reference models: HuggingFace Llama / GPT-2 built on meta from presets, run on meta inputs."""
from __future__ import annotations

import pytest
import torch

from scalify.errors import ConfigError
from scalify.models import PRESETS, build_reference, example_inputs, make_hf_config, reference_forward

LAYER_FIELD = {"llama": "num_hidden_layers", "gpt2": "n_layer", "mixtral": "num_hidden_layers"}


def one_layer_config(preset_name: str):
    """The preset's HF config cut to a single layer (meta tensors cost nothing, but layers cost time)."""
    preset = PRESETS[preset_name]
    return make_hf_config(preset.family, {**preset.config, LAYER_FIELD[preset.family]: 1})


def test_config_uses_eager_attention_without_cache():
    for family, config in [("llama", PRESETS["llama-tiny"].config), ("gpt2", PRESETS["gpt2-tiny"].config)]:
        hf_config = make_hf_config(family, config)
        assert hf_config._attn_implementation == "eager"
        assert hf_config.use_cache is False


def test_rope_theta_lands_in_rope_parameters():
    hf_config = make_hf_config("llama", PRESETS["llama-3.1-8b"].config)
    assert hf_config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}


@pytest.mark.parametrize("preset_name", sorted(PRESETS))
def test_every_preset_builds_on_meta_and_gives_logits(preset_name):
    family = PRESETS[preset_name].family
    hf_config = one_layer_config(preset_name)
    model = build_reference(family, hf_config)

    assert not model.training
    assert all(p.device.type == "meta" for p in model.parameters())
    logits = reference_forward(model)(**example_inputs(family, batch=2, seq=5))
    assert logits.shape == (2, 5, hf_config.vocab_size)
    assert logits.device.type == "meta" and logits.dtype == torch.float32


def test_example_inputs_are_meta_longs_with_an_all_ones_mask():
    inputs = example_inputs("llama", batch=3, seq=7)
    assert set(inputs) == {"input_ids", "attention_mask"}
    for tensor in inputs.values():
        assert tensor.shape == (3, 7) and tensor.dtype == torch.long and tensor.device.type == "meta"


def test_gpt2_lm_head_is_tied_to_wte():
    model = build_reference("gpt2", make_hf_config("gpt2", PRESETS["gpt2-tiny"].config))
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


def test_llama_rotary_buffers():
    model = build_reference("llama", make_hf_config("llama", PRESETS["llama-tiny"].config))
    assert [name for name, _ in model.named_buffers()] == [
        "model.rotary_emb.inv_freq",
        "model.rotary_emb.original_inv_freq",
    ]


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown model family 'mamba'"):
        make_hf_config("mamba", {})
