"""Scalify: prove that a distributed model computes what its single-device reference computes."""
from __future__ import annotations

import importlib
from typing import Any

# Each export and the submodule that defines it. They load on first use, so that a process that
# imports one submodule (a Ray actor's, say) does not pay for torch and transformers.
_EXPORTS = {"verify": "api", "verify_graphs": "api", "verify_hlo": "api", "verify_modules": "api",
            "infer_placements": "capture.shard_fn", "Custom": "placements",
            "Partial": "placements", "Piece": "placements", "Replicate": "placements",
            "Shard": "placements", "Discrepancy": "report.model", "Report": "report.model"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scalify' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
