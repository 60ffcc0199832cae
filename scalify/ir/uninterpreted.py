"""Aten ops the prover treats as uninterpreted functions: their shape and value come from the
aten overload itself, and no rewrite rule mentions them.

Two applications to equal inputs with equal attributes are equal (congruence); nothing else is
known about them (convolution, pooling, FFTs, sorting, general gathers and scatters). A node's
inputs fill the overload's tensor arguments in schema order; every other argument is an
attribute named as in the schema: a tensor argument passed None is None, a list of optional
tensors a tuple of booleans (True: the next input), and `output` picks one result of an
overload with several.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

Shape = tuple[int, ...]
Attrs = dict[str, Any]

_aten = torch.ops.aten


def _takes_tensor(arg: Any) -> bool:
    return str(arg.type) in ("Tensor", "Optional[Tensor]")


def _takes_tensor_list(arg: Any) -> bool:
    return str(arg.type) in ("List[Tensor]", "List[Optional[Tensor]]")


def _plain(value: Any) -> Any:
    """An argument as an attribute value: lists become tuples (attributes are hashed)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class AtenApplication:
    """One aten overload as an IR op; `dtypes` are its tensor inputs' dtypes for the shape rule
    (float32 where none is given), `same_shape` says its output has its first input's shape
    (for an overload whose meta kernel needs more than shapes)."""

    overload: Any
    dtypes: tuple[torch.dtype, ...] = ()
    same_shape: bool = False

    def attributes(self, args: list, kwargs: dict,
                   is_tensor: Callable[[Any], bool]) -> tuple[list, Attrs]:
        """A call's tensors (the node's inputs, in order) and its other arguments by name,
        defaults filled in."""
        schema = self.overload._schema.arguments
        unknown = set(kwargs) - {arg.name for arg in schema}
        if unknown or len(args) > sum(not arg.kwarg_only for arg in schema):
            raise ValueError(f"{self.overload} takes no {sorted(unknown) or 'more arguments'}")
        inputs: list = []
        attrs: Attrs = {}
        for position, arg in enumerate(schema):
            if arg.name in kwargs:
                value = kwargs[arg.name]
            elif position < len(args) and not arg.kwarg_only:
                value = args[position]
            else:
                value = arg.default_value if arg.has_default_value() else None
            if _takes_tensor_list(arg):
                inputs += [v for v in value if is_tensor(v)]
                attrs[arg.name] = tuple(is_tensor(v) for v in value)
            elif _takes_tensor(arg) and value is not None:
                inputs.append(value)
            elif is_tensor(value):
                raise ValueError(f"{self.overload} takes no tensor as {arg.name}")
            else:
                attrs[arg.name] = _plain(value)
        return inputs, attrs

    def arguments(self, inputs: list, attrs: Attrs) -> tuple[list, dict]:
        """The call that `attributes` describes, with `inputs` as its tensors."""
        values: Iterator = iter(inputs)
        args, kwargs = [], {}
        for arg in self.overload._schema.arguments:
            if _takes_tensor_list(arg):
                value = [next(values) if present else None for present in attrs[arg.name]]
            elif arg.name in attrs:
                value = attrs[arg.name]
            else:
                value = next(values)
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
        return args, kwargs

    def run(self, inputs: list[torch.Tensor], attrs: Attrs) -> torch.Tensor:
        args, kwargs = self.arguments(inputs, attrs)
        result = self.overload(*args, **kwargs)
        return result[attrs["output"]] if "output" in attrs else result

    def shape(self, shapes: list[Shape], attrs: Attrs) -> Shape:
        """The output shape, from the overload's meta kernel; ValueError if it refuses."""
        if self.same_shape:
            return shapes[0]
        dtypes = self.dtypes + (torch.float32,) * (len(shapes) - len(self.dtypes))
        inputs = [torch.empty(shape, dtype=dtype, device="meta")
                  for shape, dtype in zip(shapes, dtypes)]
        try:
            return tuple(self.run(inputs, attrs).shape)
        except (RuntimeError, StopIteration, TypeError, IndexError) as error:
            raise ValueError(f"{self.overload} does not accept inputs of shapes {shapes} "
                             f"with {attrs}: {str(error).splitlines()[0] if str(error) else error}")


MAX_INPUTS = 4  # the prover's uninterpreted functions take at most four tensors (rules/terms.py)
_INDEX, _MASK, _COMPLEX = torch.int64, torch.bool, torch.complex64

# IR op name -> the overload it applies.
APPLICATIONS: dict[str, AtenApplication] = {
    "convolution": AtenApplication(_aten.convolution.default),
    "convolution_backward": AtenApplication(_aten.convolution_backward.default),
    "avg_pool2d": AtenApplication(_aten.avg_pool2d.default),
    "avg_pool2d_backward": AtenApplication(_aten.avg_pool2d_backward.default),
    "avg_pool3d": AtenApplication(_aten.avg_pool3d.default),
    "adaptive_avg_pool2d_backward": AtenApplication(_aten._adaptive_avg_pool2d_backward.default),
    "adaptive_avg_pool3d": AtenApplication(_aten._adaptive_avg_pool3d.default),
    "cdist": AtenApplication(_aten._cdist_forward.default),
    "pdist": AtenApplication(_aten._pdist_forward.default),
    "embedding_bag": AtenApplication(_aten._embedding_bag.default, (torch.float32, _INDEX, _INDEX)),
    "embedding_bag_forward_only": AtenApplication(_aten._embedding_bag_forward_only.default,
                                                  (torch.float32, _INDEX, _INDEX)),
    "fft_r2c": AtenApplication(_aten._fft_r2c.default),
    "fft_c2r": AtenApplication(_aten._fft_c2r.default, (_COMPLEX,)),
    "sort": AtenApplication(_aten.sort.default),
    "sort_stable": AtenApplication(_aten.sort.stable),
    "masked_scatter": AtenApplication(_aten.masked_scatter.default, (torch.float32, _MASK)),
    "gather": AtenApplication(_aten.gather.default, (torch.float32, _INDEX)),
    "scatter": AtenApplication(_aten.scatter.src, (torch.float32, _INDEX)),
    "scatter_value": AtenApplication(_aten.scatter.value, (torch.float32, _INDEX)),
    "scatter_add": AtenApplication(_aten.scatter_add.default, (torch.float32, _INDEX)),
    "scatter_reduce": AtenApplication(_aten.scatter_reduce.two, (torch.float32, _INDEX)),
    "index_put": AtenApplication(_aten.index_put.default, same_shape=True),
}
