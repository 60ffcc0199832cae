"""Scalify: prove that a distributed model computes what its single-device reference computes."""
from __future__ import annotations

import importlib
from typing import Any

from . import verify as _verify_package  # noqa: F401  first, so that `verify` below is the function

# Each export and the submodule that defines it. They load on first use, so that a process that
# imports one submodule (a Ray actor's, say) does not pay for torch and transformers.
_EXPORTS = {"verify_graphs": "api", "verify_hlo": "api", "verify_jax": "api",
            "verify_modules": "api", "infer_placements": "capture.shard_fn", "Custom": "placements",
            "Partial": "placements", "Piece": "placements", "Replicate": "placements",
            "Shard": "placements", "Discrepancy": "report.model", "Report": "report.model"}

__all__ = sorted([*_EXPORTS, "verify"])


def verify(*args: Any, **kwargs: Any) -> Any:
    """`scalify.api.verify`: capture an experiment's programs and prove them equivalent."""
    from .api import verify as run

    return run(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scalify' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
