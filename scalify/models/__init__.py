"""Reference models: real HuggingFace code on the meta device, with presets by name."""
from scalify.models.presets import PRESETS, ModelPreset
from scalify.models.reference import build_reference, example_inputs, make_hf_config, reference_forward

__all__ = ["PRESETS", "ModelPreset", "build_reference", "example_inputs", "make_hf_config", "reference_forward"]
