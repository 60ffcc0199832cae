"""Encodes one IR node, given its arguments' egglog terms, as an egglog term."""
from __future__ import annotations

from ..ir.graph import Node
from ..ir.ops import OPS, UNARY, BINARY
from ..ir.symmetry import RankAffine
from ..rules.terms import op_key, render
from .relations import concat_terms, nest

_INT_COMPARISONS = {"lt_scalar": "lt", "le_scalar": "le", "gt_scalar": "gt", "ge_scalar": "ge",
                    "eq_scalar": "eq", "ne_scalar": "ne"}
_PLAIN = {"where": "where3", "embedding": "embedding"}


def _is_integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def _attrs(node: Node, *skip: str) -> dict:
    return {k: v for k, v in node.attrs if k not in skip}


def encode(node: Node, args: list[str], arg_shapes: list[tuple[int, ...]]) -> str:
    """The egglog term for `node` applied to the terms `args` (whose shapes are `arg_shapes`)."""
    op, attrs = node.op, dict(node.attrs)
    trait = OPS[op].trait
    if "family" in attrs:
        return _family_collective(node, args[0], arg_shapes[0])
    if isinstance(attrs.get("value"), RankAffine):
        value = attrs["value"]
        if op == "add_scalar":
            return f"(add_int_r {args[0]} {value.scale} {value.offset})"
        return f'(cmp_int_r "{_INT_COMPARISONS[op]}" {args[0]} {value.scale} {value.offset})'
    if op == "slice" and isinstance(attrs["start"], RankAffine):
        return f"(rslice {args[0]} {attrs['dim']} {attrs['start'].scale})"
    if op == "pad" and isinstance(attrs["before"], RankAffine):
        return f"(rpad {args[0]} {attrs['dim']} {attrs['before'].scale})"
    integer = isinstance(attrs.get("value"), int)
    if op in _INT_COMPARISONS and integer:
        return f'(cmp_int "{_INT_COMPARISONS[op]}" {args[0]} {attrs["value"]})'
    if op == "add_scalar" and integer and _is_integer(node.dtype):  # index arithmetic
        return f"(add_int {args[0]} {attrs['value']})"
    if op == "pad":
        return (f"(pad {args[0]} {attrs['dim']} {attrs['before']} {attrs['after']} "
                f"{render(repr(attrs['value']))})")
    if op == "masked_fill":
        return f"(masked_fill {args[0]} {args[1]} {render(repr(attrs['value']))})"
    if trait == UNARY:
        return f"(unary {render(op_key(op, attrs))} {args[0]})"
    if trait == BINARY:
        return f"(binary {render(op_key(op, attrs))} {args[0]} {args[1]})"
    if op == "take":  # the class dim is the source's last
        return f"(take {args[0]} {args[1]} {len(arg_shapes[0]) - 1})"
    if op == "untake":
        return f"(untake {args[0]} {args[1]} {attrs['size']} {len(arg_shapes[1])})"
    if op == "embedding_grad":
        return f"(embedding_grad {args[0]} {args[1]} {attrs['rows']})"
    if op in _PLAIN:
        return f"({_PLAIN[op]} {' '.join(args)})"
    if op in ("sum", "amax", "logsumexp"):
        return f'(reduce "{op}" {args[0]} {attrs["dim"]})'
    if op in ("softmax", "log_softmax"):
        return f'(softmax "{op}" {args[0]} {attrs["dim"]})'
    if op == "matmul":
        return f"(matmul {args[0]} {args[1]} {len(node.shape)})"
    if op in ("merge", "split"):
        return f"({op} {args[0]} {attrs['dim']} {attrs['inner']})"
    if op in ("unsqueeze", "squeeze"):
        return f"({op} {args[0]} {attrs['dim']})"
    if op == "transpose":
        return f"(transpose {args[0]} {attrs['dim0']} {attrs['dim1']})"
    if op == "expand":
        return f"(expand {args[0]} {attrs['dim']} {attrs['size']})"
    if op == "slice":
        return f"(slice {args[0]} {attrs['dim']} {attrs['start']} {attrs['end']})"
    if op == "concat":
        return concat_terms(args, [s[attrs["dim"]] for s in arg_shapes], attrs["dim"])
    if op == "all_reduce":
        return nest("pmax" if attrs["reduce"] == "max" else "psum", args)
    if op == "all_gather":
        return concat_terms(args, [s[0] for s in arg_shapes], 0)
    if op == "all_to_all":
        return _all_to_all(attrs["index"], args, attrs["member_splits"])
    if op == "reduce_scatter":
        dim = attrs.get("dim", 0)
        size = node.shape[dim]
        start = attrs["index"] * size
        return f"(slice {nest('psum', args)} {dim} {start} {start + size})"
    key = render(op_key(op, _attrs(node, "shape")))
    return f"(opaque{len(args)} {key} {' '.join(args)})"


def _all_to_all(rank: int, args: list[str], member_splits: tuple) -> str:
    """Rank `rank`'s output: block `rank` of every member's input, concatenated along dim 0."""
    blocks = []
    for arg, splits in zip(args, member_splits):
        start = sum(splits[:rank])
        blocks.append(f"(slice {arg} 0 {start} {start + splits[rank]})")
    return concat_terms(blocks, [splits[rank] for splits in member_splits], 0)


def _family_collective(node: Node, arg: str, arg_shape: tuple[int, ...]) -> str:
    """A collective of the symbolic program: a term over the whole rank family."""
    if node.op == "all_reduce":
        return f"({'rmax' if node.attr('reduce') == 'max' else 'rsum'} {arg})"
    if node.op == "all_gather":
        dim = node.attr("dim", 0)
        return f"(rcat {arg} {dim} {arg_shape[dim]})"
    dim = node.attr("dim", 0)  # reduce_scatter
    return f"(rslice (rsum {arg}) {dim} {node.shape[dim]})"
