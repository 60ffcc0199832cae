"""Where each module's tensor-parallel plan entry was written. A wrong style in a
`parallelize_module` plan (a rowwise output left `Partial()`) adds or leaves out collectives at
the module's edges, far from the plan; the capture names the plan entry with every op of the
module it parallelized."""
from __future__ import annotations

import linecache
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed.tensor.parallel as tensor_parallel
import torch.distributed.tensor.parallel.api as api
from torch import nn

from .group_origins import user_frame

_PARALLELIZE = api.parallelize_module.__code__  # torch's own (the recursion runs through it)


class PlanOrigins:
    """`file:line`s of the plan entries applied to each module while `recording()`."""

    def __init__(self) -> None:
        self._lines: dict[int, tuple[str, ...]] = {}

    def by_module_name(self, root: nn.Module) -> dict[str, tuple[str, ...]]:
        """The plan lines of `root`'s modules, by their names in it."""
        return {name: self._lines[id(module)] for name, module in root.named_modules()
                if id(module) in self._lines}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Every parallel style's `_apply` (how `parallelize_module` gives a module its style,
        however the user imported it) records the plan entry for that module."""
        applies = {style: style.__dict__["_apply"] for style in _styles()
                   if "_apply" in style.__dict__}

        def recorded(apply: Any) -> Any:
            def _apply(style: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                entry = _plan_entry(sys._getframe(1))
                if entry is not None:
                    known = self._lines.get(id(module), ())
                    self._lines[id(module)] = tuple(dict.fromkeys((*known, entry)))
                return apply(style, module, *args, **kwargs)
            return _apply

        for style, apply in applies.items():
            style._apply = recorded(apply)
        try:
            yield
        finally:
            for style, apply in applies.items():
                style._apply = apply


def _styles() -> list[type]:
    """ParallelStyle and its subclasses (torch's and any the user defined)."""
    found, pending = [], [tensor_parallel.ParallelStyle]
    while pending:
        style = pending.pop()
        found.append(style)
        pending += style.__subclasses__()
    return found


def _plan_entry(frame: Any) -> str | None:
    """The line of the plan entry being applied: the line naming the key of the outermost
    `parallelize_module` call's plan (the one nearest before that call, else the first in the
    caller's file), or the call's line when it was given a style itself."""
    key, outermost, start = None, None, frame
    while frame is not None:
        if frame.f_code is _PARALLELIZE:
            outermost = frame
            key = frame.f_locals.get("module_path", key)
        frame = frame.f_back
    user = user_frame(outermost.f_back if outermost is not None else start)
    if user is None:
        return None
    file, call = user.f_code.co_filename, user.f_lineno
    quoted = (f'"{key}"', f"'{key}'")
    lines = [n for n, text in enumerate(linecache.getlines(file), 1)
             if key and any(q in text for q in quoted)]
    before = [n for n in lines if n <= call]
    return f"{file}:{before[-1] if before else lines[0] if lines else call}"
