"""A DTensor plan as a config states it: module-name globs mapped to parallel styles.

Styles are `torch.distributed.tensor.parallel` classes with their constructor options, or the
short names HuggingFace's `base_model_tp_plan` uses ("colwise", "rowwise", ...). This module
only validates and holds the plan (no torch import); scalify/parallel/dtensor.py builds it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from scalify.placements import Placement, Replicate, Shard

HF_PLAN = "hf"
Layout = Placement | None  # None: an argument the style leaves alone


@dataclass(frozen=True)
class StyleSpec:
    """One `torch.distributed.tensor.parallel` style and its constructor options."""

    style: str
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class DTensorPlan:
    """HuggingFace's own plan for the model (`hf`), or explicit (module glob, style) entries."""

    hf: bool = False
    entries: tuple[tuple[str, StyleSpec], ...] = ()


class PlanError(ValueError):
    """A problem at `path` (keys below the plan) of a plan entry."""

    def __init__(self, path: tuple[str, ...], problem: str) -> None:
        super().__init__(problem)
        self.path = path
        self.problem = problem


_OPTIONS: dict[str, dict[str, str]] = {
    "ColwiseParallel": {"input_layouts": "layout", "output_layouts": "layout", "use_local_output": "bool"},
    "RowwiseParallel": {"input_layouts": "layout", "output_layouts": "layout", "use_local_output": "bool"},
    "SequenceParallel": {"sequence_dim": "int", "use_local_output": "bool"},
    "PrepareModuleInput": {"input_layouts": "layouts", "desired_input_layouts": "layouts",
                           "input_kwarg_layouts": "kwarg_layouts",
                           "desired_input_kwarg_layouts": "kwarg_layouts", "use_local_output": "bool"},
    "PrepareModuleOutput": {"output_layouts": "layouts", "desired_output_layouts": "layouts",
                            "use_local_output": "bool"},
}
STYLES = tuple(_OPTIONS)


def _colwise(output: Placement, *, rowwise: bool = False, input: Placement | None = None) -> StyleSpec:
    style = "RowwiseParallel" if rowwise else "ColwiseParallel"
    return StyleSpec(style, (("input_layouts", input or (Shard(-1) if rowwise else Replicate())),
                             ("output_layouts", output)))


HF_STYLES: dict[str, StyleSpec] = {
    "colwise": _colwise(Shard(-1)),
    "colwise_gather_output": _colwise(Replicate()),
    "colwise_rep": _colwise(Replicate()),
    "rowwise": _colwise(Replicate(), rowwise=True),
    "rowwise_rep": _colwise(Replicate(), rowwise=True, input=Replicate()),
    "rowwise_split_input": _colwise(Replicate(), rowwise=True, input=Replicate()),
    "embedding_rowwise": _colwise(Replicate(), rowwise=True, input=Replicate()),
    "sequence_parallel": StyleSpec("SequenceParallel", (("use_local_output", True),)),
}
"""HuggingFace's style names, as the torch styles that do the same."""

_LAYOUT = re.compile(r"^(?:(replicate)(?:\(\))?|shard\((-?\d+)\))$")


def parse_layout(value: Any, path: tuple[str, ...]) -> Layout:
    """`replicate`, `shard(d)` (any case, `Replicate()` too) or null."""
    if value is None:
        return None
    match = _LAYOUT.match(value.strip().lower()) if isinstance(value, str) else None
    if match is None:
        raise PlanError(path, f"expected a layout: replicate, shard(<dim>) or null, got {value!r}")
    return Replicate() if match.group(1) else Shard(int(match.group(2)))


def _option(kind: str, value: Any, path: tuple[str, ...]) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            raise PlanError(path, f"expected true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(path, f"expected an integer, got {value!r}")
        return value
    if kind == "layout":
        return parse_layout(value, path)
    if kind == "layouts":
        values = value if isinstance(value, list) else [value]
        return tuple(parse_layout(v, (*path, str(i))) for i, v in enumerate(values))
    if not isinstance(value, dict):
        raise PlanError(path, f"expected a mapping of argument names to layouts, got {value!r}")
    return tuple((str(k), parse_layout(v, (*path, str(k)))) for k, v in value.items())


def parse_style(value: Any, path: tuple[str, ...]) -> StyleSpec:
    """A style name, or a mapping `{style: <name>, <option>: <value>, ...}`."""
    names = f"{', '.join(STYLES)} or one of HuggingFace's {', '.join(HF_STYLES)}"
    fields = dict(value) if isinstance(value, dict) else {"style": value}
    name = fields.pop("style", None)
    style_path = (*path, "style") if isinstance(value, dict) else path
    if name in HF_STYLES:
        base = HF_STYLES[name]
    elif name in _OPTIONS:
        base = StyleSpec(name)
    else:
        raise PlanError(style_path, f"expected a parallel style ({names}), got {name!r}")
    allowed = _OPTIONS[base.style]
    options = dict(base.options)
    for key, option in fields.items():
        if key not in allowed:
            raise PlanError((*path, str(key)), f"unknown option of {base.style} "
                            f"(expected one of: {', '.join(sorted(allowed))})")
        options[key] = _option(allowed[key], option, (*path, str(key)))
    return StyleSpec(base.style, tuple(sorted(options.items())))


def parse_plan(value: Any) -> DTensorPlan:
    """`hf`, or a mapping from module-name glob (e.g. `model.layers.*.mlp.up_proj`) to style."""
    if value == HF_PLAN:
        return DTensorPlan(hf=True)
    if not isinstance(value, dict) or not value:
        raise PlanError((), f"expected {HF_PLAN!r} or a mapping from module-name glob to style, "
                            f"got {value!r}")
    entries = []
    for glob, style in value.items():
        if not isinstance(glob, str) or not glob:
            raise PlanError((str(glob),), "expected a module-name glob such as model.layers.*.mlp")
        entries.append((glob, parse_style(style, (glob,))))
    return DTensorPlan(entries=tuple(entries))
