"""Lowers ops whose values no program text determines: random draws, each a node of its own
that equals no other (not even an identical call), and `nonzero`, whose output's shape depends
on its input's values (kept opaque)."""
from __future__ import annotations

import uuid
from typing import Any

from ..errors import CaptureError
from .aten import Result, _dtype_name, _out_shape, lowering
from .builder import GraphBuilder


@lowering("rand", "randn", "randperm", "rand_like", "randn_like")
def _draw(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    """A fresh draw, told apart from every other by a unique `draw` attribute: two draws, in one
    program or in two, are never proven equal (even with one seed)."""
    dtype = _dtype_name(out.dtype)
    return b.emit(name.removesuffix("_like"), [], dtype, shape=_out_shape(out), dtype=dtype,
                  draw=uuid.uuid4().hex)


@lowering("nonzero")
def _nonzero(b: GraphBuilder, name: str, args: list, kwargs: dict, out: Any) -> Result:
    raise CaptureError("its output's shape depends on its input's values, which a "
                       "graph of fixed shapes cannot follow")
