"""How much of the core ATen opset the tracer lowers: `python -m scalify.capture.coverage`.

Every overload tagged `torch.Tag.core` is run on small meta tensors built from its schema and
captured; it counts as lowered when its graph holds no opaque node (through a hand lowering,
PyTorch's decomposition, or as an identity). An overload whose arguments could not be built
is classified by the tables alone, and said so; coverage_samples.py lists the arguments of
overloads whose schema does not say how to call them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import DataDependentRead, ScalifyError
from ..ir.ops import OPS, RANDOM, UNINTERPRETED
from .aten import LOWERINGS, lowering_name
from .coverage_samples import sample
from .decompose import decomposition_of
from .sampled_reads import logged_reads
from .tracer import capture

_SHAPES = [(4, 4), (2, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4, 4), (4,)]
_INT_LISTS = {"kernel_size": [2, 2], "stride": [1, 1], "padding": [0, 0], "dilation": [1, 1],
              "output_padding": [0, 0], "output_size": [2, 2], "pad": [1, 1], "padding_idx": -1}
_SHAPE_QUERIES = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "sym_is_contiguous"}


@dataclass
class Coverage:
    """Core overloads by how they lower; `unprobed` were classified by the tables alone."""

    lowered: dict[str, str] = field(default_factory=dict)  # overload -> how
    missing: dict[str, str] = field(default_factory=dict)  # overload -> why not
    unprobed: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.lowered) + len(self.missing)

    @property
    def share(self) -> float:
        return len(self.lowered) / self.total


def core_overloads() -> list[Any]:
    """Every aten overload tagged core, by name: of every op the dispatcher registers, not
    only the packets this process has touched (`torch.ops.aten` loads them lazily)."""
    found = []
    names = {op.split("::")[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names()
             if op.startswith("aten::")}
    for name in sorted(names):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            found += [getattr(packet, overload) for overload in packet.overloads()
                      if torch.Tag.core in getattr(packet, overload).tags]
    return sorted(found, key=str)


def _argument(arg: Any, shape: tuple[int, ...]) -> Any:
    """A sample value for one schema argument (None: leave it to its default)."""
    kind, name = str(arg.type), arg.name
    if arg.has_default_value() and name not in _INT_LISTS:
        return None
    kind = kind.removeprefix("Optional[").removesuffix("]") if kind.startswith("Optional[") else kind
    if kind == "Tensor":
        dtype = (torch.int64 if name in ("index", "indices", "target", "offsets") else
                 torch.bool if name in ("condition", "mask") else torch.float32)
        return torch.zeros(shape, dtype=dtype, device="meta")
    if kind.startswith("List[") and "Tensor" in kind:
        integer = name == "indices"
        return [torch.zeros(shape, dtype=torch.int64 if integer else torch.float32,
                            device="meta")] * (1 if integer else 2)
    if name in _INT_LISTS:
        return _INT_LISTS[name]
    if kind == "List[int]":
        return list(shape) if name in ("size", "shape", "sizes") else [0]
    if kind == "int":
        return 0 if name in ("dim", "start", "index") else 2
    return {"number": 2, "float": 0.5, "bool": False, "str": "sum"}.get(kind)


def _sample(func: Any) -> tuple[list, dict] | None:
    """Arguments `func` accepts on meta tensors, or None."""
    for shape in _SHAPES:
        args, kwargs = [], {}
        for arg in func._schema.arguments:
            value = _argument(arg, shape)
            if arg.kwarg_only:
                if value is not None:
                    kwargs[arg.name] = value
            else:
                args.append(value)
        while args and args[-1] is None:
            args.pop()
        try:
            func(*args, **kwargs)
        except Exception:  # noqa: BLE001  (any refusal: try the next shape)
            continue
        return args, kwargs
    return None


def _how(func: Any) -> str:
    if lowering_name(func)[0] in LOWERINGS:
        return "hand lowering"
    return "decomposition" if decomposition_of(func) is not None else ""


def _probe(func: Any, args: list, kwargs: dict) -> tuple[str | None, str]:
    """Why capturing `func(*args, **kwargs)` leaves an opaque node (None when it lowers), and
    the ops of its graph that the prover takes as uninterpreted functions or random draws (or
    that its values were read on a sampled run)."""
    tensors = {f"a{i}": t for i, t in enumerate(x for x in tree_leaves((args, kwargs))
                                                if isinstance(x, torch.Tensor))}
    run = lambda: _as_outputs(func(*args, **kwargs))
    try:
        try:
            graph, sampled = capture(nn.Module(), run, tensors), ""
        except DataDependentRead:  # as verify_modules does: sampled on real numbers, replayed
            real_args, real_kwargs = tree_map(lambda t: torch.ones(t.shape, dtype=t.dtype) if
                                              isinstance(t, torch.Tensor) and t.is_meta else t,
                                              (args, kwargs))
            log = logged_reads(lambda: _as_outputs(func(*real_args, **real_kwargs)))
            graph = capture(nn.Module(), run, tensors, replay=log)
            sampled = " (its values read on a sampled run)"
    except ScalifyError as error:
        return str(error), ""
    opaque = [node for node in graph if node.op == "opaque"]
    if opaque:
        return f"{opaque[0].attr('target')}: {opaque[0].attr('reason')}", ""
    special = sorted({node.op for node in graph
                      if node.op in UNINTERPRETED or OPS[node.op].trait == RANDOM})
    return None, (f" (uninterpreted or random: {', '.join(special)})" if special else "") + sampled


def _as_outputs(result: Any) -> list:
    results = result if isinstance(result, (tuple, list)) else [result]
    return [r for r in results if isinstance(r, torch.Tensor)]


def measure() -> Coverage:
    coverage = Coverage()
    for func in core_overloads():
        name, how = str(func), _how(func)
        if func.overloadpacket.__name__ in _SHAPE_QUERIES:
            coverage.lowered[name] = "shape query (answered at capture)"
            continue
        arguments = sample(name) or _sample(func)
        if arguments is None:
            coverage.unprobed.append(name)
            target = coverage.lowered if how else coverage.missing
            target[name] = how or "no lowering or decomposition"
            continue
        failure, special = _probe(func, *arguments)
        if failure is None:
            coverage.lowered[name] = (how or "identity") + special
        else:
            coverage.missing[name] = failure
    return coverage


def main() -> None:
    coverage = measure()
    print(f"core ATen ops lowered: {len(coverage.lowered)}/{coverage.total} "
          f"({100 * coverage.share:.0f}%)")
    print(f"not lowered ({len(coverage.missing)}):")
    for name, why in coverage.missing.items():
        print(f"  {name}: {why}")
    print("lowered:")
    for name, how in coverage.lowered.items():
        print(f"  {name}: {how}")
    print(f"classified by the tables alone, no sample built ({len(coverage.unprobed)}): "
          f"{', '.join(coverage.unprobed)}")


if __name__ == "__main__":
    main()
