"""Reference models: real HuggingFace code on the meta device, with presets by name."""
from typing import Any

from scalify.models.presets import PRESETS, ModelPreset

_REFERENCE = ("build_reference", "example_inputs", "make_hf_config", "reference_forward")


def __getattr__(name: str) -> Any:
    """The HuggingFace-backed builders load on first use: importing transformers takes seconds,
    which processes that only read configs or prove segments need not pay."""
    if name in _REFERENCE:
        from scalify.models import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'scalify.models' has no attribute {name!r}")


__all__ = ["PRESETS", "ModelPreset", *_REFERENCE]
