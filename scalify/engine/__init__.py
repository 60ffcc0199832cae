"""Executors: where a verification's segments are proved. Inline (this process) by default; on
Ray actors when the experiment's `engine` asks for it or RAY_ADDRESS is set. Verification logic
lives in `scalify.verify`; this package only moves it, and only its Ray modules import ray."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .inline import InlineExecutor
from .job import Executor, VerifyJob

if TYPE_CHECKING:
    from ..config import EngineSpec


def executor_for(spec: EngineSpec) -> Executor:
    """The executor an experiment's `engine` section asks for: `auto` is Ray when RAY_ADDRESS is
    set, else inline. Ray is joined (or started) on first use."""
    kind = spec.kind
    if kind == "auto":
        kind = "ray" if os.environ.get("RAY_ADDRESS") else "inline"
    if kind == "inline":
        return InlineExecutor()
    from .ray_executor import RayExecutor

    return RayExecutor(spec.address, spec.actors, spec.checkpoint)


__all__ = ["Executor", "InlineExecutor", "VerifyJob", "executor_for"]
