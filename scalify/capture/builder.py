"""Emits core-op nodes into a graph, computing shapes, plus the shape-changing helpers frontends share."""
from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from itertools import accumulate
from math import prod
from typing import Any

from ..ir.graph import Graph, Node, SourceLoc
from ..ir.ops import infer_shape

# Dtypes whose arithmetic with a Python scalar runs in float32 (the half types' op math too).
_SINGLE_ARITHMETIC = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class Ref:
    """A tensor-valued argument seen by a frontend: the node that produced it."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LogSoftmaxParts:
    """A log-softmax over `dim` spelled out: `shifted` = x - max, `total` = sum(exp(shifted)),
    `log_sum_exp` = log(total); the log-probabilities are shifted - log_sum_exp."""

    dim: int
    shifted: Ref
    total: Ref
    log_sum_exp: Ref


class GraphBuilder:
    """Appends nodes to a graph; every node gets the current source location."""

    def __init__(self, prefix: str = "n") -> None:
        self.graph = Graph()
        self.source = SourceLoc()
        self._prefix = prefix
        self._count = 0
        # Pieces of composite values later lowerings reuse, by the value's node name: a loss
        # picks from a log-softmax's shifted logits, its backward uses their exponentials.
        self.log_softmax_parts: dict[str, LogSoftmaxParts] = {}

    def emit(self, op: str, inputs: list[Ref], out_dtype: str | None = None, **attrs: Any) -> Ref:
        shape = infer_shape(op, [ref.shape for ref in inputs], attrs)
        dtype = out_dtype or (inputs[0].dtype if inputs else "float32")
        if op == "add_scalar" and dtype in _SINGLE_ARITHMETIC and isinstance(attrs["value"], float):
            attrs["value"] = _single(attrs["value"])  # x + 1e-5 adds float32(1e-5), as C++ does
        name = f"{self._prefix}{self._count}"
        self._count += 1
        node = Node(name, op, tuple(ref.name for ref in inputs), tuple(sorted(attrs.items())),
                    shape, dtype, self.source)
        self.graph.add(node)
        return Ref(name, shape, dtype)

    def emit_placeholder(self, target: str, kind: str, shape: tuple[int, ...], dtype: str,
                         layout: tuple = ()) -> Ref:
        """A program input (parameter, buffer or input) named by its target; `layout`: how this
        rank holds it when it is a DTensor (`capture.dtensor.dtensor_layout`)."""
        attrs = (("kind", kind), ("shape", shape), ("target", target))
        node = Node(target, "placeholder", (), attrs + ((("layout", layout),) if layout else ()),
                    shape, dtype, SourceLoc(module=target))
        self.graph.add(node)
        return Ref(target, shape, dtype)

    # Shape helpers: express framework reshapes/broadcasts with size-free core movement ops.

    def broadcast(self, ref: Ref, shape: tuple[int, ...]) -> Ref:
        """Make broadcasting explicit: leading unsqueezes, then one expand per stretched dim;
        a new dim of size 1 behind a stretched one comes last, as an unsqueeze of the expanded
        value (a bias over `[s, 1, h]` is the bias over the `[s, h]` rows with a unit dim, as a
        reference that adds it to squeezed rows holds it; a leading `[1, s, h]` keeps its
        unit dim in front, where a sequence split along the next dim finds it)."""
        unit = [dim for dim in range(len(shape) - len(ref.shape))
                if shape[dim] == 1 and any(size != 1 for size in shape[:dim])]
        stretched = tuple(size for dim, size in enumerate(shape) if dim not in unit)
        while len(ref.shape) < len(stretched):
            ref = self.emit("unsqueeze", [ref], dim=0)
        for dim, (have, want) in enumerate(zip(ref.shape, stretched)):
            if have != want:
                if have != 1:
                    raise ValueError(f"cannot broadcast {ref.shape} to {shape}")
                ref = self.emit("expand", [ref], dim=dim, size=want)
        for dim in unit:
            ref = self.emit("unsqueeze", [ref], dim=dim)
        return ref

    def reshape(self, ref: Ref, shape: tuple[int, ...]) -> Ref:
        """A reshape as squeezes, merges of adjacent dims, splits and unsqueezes.

        Dims shared by both shapes at the front and back are left alone, so size-1 batch dims
        do not churn through squeeze/unsqueeze pairs.
        """
        shape = _resolve_minus_one(ref.shape, shape)
        if shape == ref.shape:
            return ref
        front = 0
        while front < min(len(shape), len(ref.shape)) and shape[front] == ref.shape[front]:
            front += 1
        back = 0
        while (back < min(len(shape), len(ref.shape)) - front
               and shape[-1 - back] == ref.shape[-1 - back]):
            back += 1
        middle_in = ref.shape[front:len(ref.shape) - back]
        middle_out = shape[front:len(shape) - back]
        for offset in reversed(range(len(middle_in))):
            if middle_in[offset] == 1:
                ref = self.emit("squeeze", [ref], dim=front + offset)
        # A size-1 dim made just before a dim that a group splits is split off that dim first:
        # the spelling of a reshape whose dim is n in the reference and 1 on each rank (one kv
        # head group per rank: [b, s, 48] -> [b, s, 1, 6, 8] as the reference's [b, s, 96] ->
        # [b, s, 2, 6, 8]), so that the two graphs take the same steps.
        dim, made = front, set()
        positions = iter(offset for offset, size in enumerate(middle_out) if size != 1)
        for group in _reshape_groups([s for s in middle_in if s != 1],
                                     [s for s in middle_out if s != 1]):
            first = next(positions)
            if len(group[1]) > 1 and first > 0 and middle_out[first - 1] == 1:
                ref = self.emit("split", [ref], dim=dim, inner=ref.shape[dim])
                made.add(first - 1)
                dim += 1
            ref = self._reshape_group(ref, dim, *group)
            dim += len(group[1])
            for _ in group[1][1:]:
                next(positions)
        for offset, size in enumerate(middle_out):
            if size == 1 and offset not in made:
                ref = self.emit("unsqueeze", [ref], dim=front + offset)
        return ref

    def _reshape_group(self, ref: Ref, dim: int, sizes_in: list[int], sizes_out: list[int]) -> Ref:
        """Dims `sizes_in` from `dim` on reshaped into `sizes_out` (as many elements): each dim
        split into the common refinement of both shapes and the refined dims merged into the
        outputs ([16, 16] -> [8, 8, 4] as [8, 2, 4, 4]), where one exists; else all merged into
        one dim and split."""
        refined = _common_refinement(sizes_in, sizes_out)
        if refined is None:
            for _ in range(len(sizes_in) - 1):
                ref = self.emit("merge", [ref], dim=dim, inner=ref.shape[dim + 1])
            splits, merges = [sizes_out], [[size] for size in sizes_out]
        else:
            splits, merges = _runs(refined, sizes_in), _runs(refined, sizes_out)
        at = dim
        for factors in splits:
            for offset in range(len(factors) - 1):
                ref = self.emit("split", [ref], dim=at + offset, inner=prod(factors[offset + 1:]))
            at += len(factors)
        at = dim
        for run in merges:
            for _ in range(len(run) - 1):
                ref = self.emit("merge", [ref], dim=at, inner=ref.shape[at + 1])
            at += 1
        return ref

    def permute(self, ref: Ref, perm: list[int]) -> Ref:
        """A permutation as a sequence of transpositions."""
        current = list(range(len(perm)))
        for position, wanted in enumerate(perm):
            source = current.index(wanted)
            if source != position:
                ref = self.emit("transpose", [ref], dim0=position, dim1=source)
                current[position], current[source] = current[source], current[position]
        return ref

    def concat(self, refs: list[Ref], dim: int) -> Ref:
        """An n-ary concatenation as right-nested binary concats."""
        result = refs[-1]
        for ref in reversed(refs[:-1]):
            result = self.emit("concat", [ref, result], dim=dim)
        return result


def _single(value: float) -> float:
    """`value` rounded to float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _resolve_minus_one(source: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    total = 1
    for size in source:
        total *= size
    known = 1
    for size in shape:
        if size != -1:
            known *= size
    resolved = tuple(total // known if size == -1 else size for size in shape)
    product = 1
    for size in resolved:
        product *= size
    if product != total:
        raise ValueError(f"cannot reshape {source} to {shape}")
    return resolved


def _common_refinement(sizes_in: list[int], sizes_out: list[int]) -> list[int] | None:
    """The coarsest sizes both shapes are merges of ([16, 16] and [8, 8, 4]: [8, 2, 4, 4]), or
    None when the shapes cut across each other ([6, 4] and [4, 6])."""
    cuts = {*accumulate(sizes_in, operator.mul), *accumulate(sizes_out, operator.mul)}
    refined, before = [], 1
    for cut in sorted(cuts):
        if cut % before:
            return None
        refined.append(cut // before)
        before = cut
    return refined


def _runs(refined: list[int], sizes: list[int]) -> list[list[int]]:
    """The refined sizes each of `sizes` is the product of, in order."""
    runs, at = [], 0
    for size in sizes:
        run = []
        while prod(run) < size:
            run.append(refined[at])
            at += 1
        runs.append(run)
    return runs


def _reshape_groups(source: list[int], target: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source dims with runs of target dims that hold the same number of elements."""
    groups, i, j = [], 0, 0
    while i < len(source):
        group_in, group_out = [source[i]], [target[j]]
        size_in, size_out = source[i], target[j]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out:
                group_in.append(source[i])
                size_in *= source[i]
                i += 1
            else:
                group_out.append(target[j])
                size_out *= target[j]
                j += 1
        groups.append((group_in, group_out))
    return groups
