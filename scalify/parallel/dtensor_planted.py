"""Planted bugs for DTensor plans: a model-code mistake and a plan mistake.

The line that does the wrong thing carries `# planted: <name>`; a verifier should point at it.
"""
from __future__ import annotations

from torch import nn

from scalify.dtensor_plan import StyleSpec

DTENSOR_PLANTED_BUGS: dict[str, str] = {}


def plant(bug: str, model: nn.Module, entries: dict[str, StyleSpec]) -> dict[str, StyleSpec]:
    """Plant `bug` in `model` (in place) and return the plan entries to apply."""
    return entries
