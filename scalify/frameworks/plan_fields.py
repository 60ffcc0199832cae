"""Checks shared by the framework plans' parsers (no torch or framework import)."""
from __future__ import annotations

from typing import Any

from scalify.dtensor_plan import PlanError


def parallel_degree(key: str, item: Any, supported: tuple[str, ...], framework: str,
                    unset: int | None = None) -> int:
    """A framework's parallel degree: a positive integer (or the framework's `unset` value),
    above 1 only for the `supported` ones."""
    if item != unset and (isinstance(item, bool) or not isinstance(item, int) or item <= 0):
        raise PlanError((key,), f"expected a positive integer, got {item!r}")
    if key not in supported and item > 1:
        raise PlanError((key,), f"not supported yet for {framework}: only "
                                f"{', '.join(supported)} may exceed 1")
    return item


def flag(key: str, item: Any) -> bool:
    """A true-or-false field."""
    if not isinstance(item, bool):
        raise PlanError((key,), f"expected true or false, got {item!r}")
    return item
