"""Arguments for the core overloads whose schema alone does not say how to call them (pooling
windows, convolution weights, index dtypes, reads of a tensor's value), for the coverage probe."""
from __future__ import annotations

from typing import Any, Callable

import torch

Sample = tuple[list, dict]


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _ids(*shape: int) -> torch.Tensor:
    return _meta(*shape, dtype=torch.int64)


def _image(*spatial: int) -> torch.Tensor:
    return _meta(2, 3, *spatial)


def _held(*shape: int) -> torch.Tensor:
    """A tensor with values (reading one into Python needs them)."""
    return torch.ones(shape)


_NORM_MASK = [True, True, True]

SAMPLES: dict[str, Callable[[], Sample]] = {
    "aten.as_strided.default": lambda: ([_meta(4, 4), [2, 2], [4, 1], 1], {}),  # a plain view
    "aten.select_scatter.default": lambda: ([_meta(4, 4), _meta(4), 0, 1], {}),
    "aten._embedding_bag.default": lambda: ([_meta(10, 4), _ids(8), _ids(2)], {}),
    "aten._fft_c2r.default": lambda: ([_meta(4, 3, dtype=torch.complex64), [1], 0, 4], {}),
    "aten._local_scalar_dense.default": lambda: ([_held()], {}),
    "aten._native_batch_norm_legit.no_stats": lambda: (
        [_image(4, 4), _meta(3), _meta(3), True, 0.1, 1e-5], {}),
    "aten.adaptive_avg_pool1d.default": lambda: ([_meta(2, 3, 8), [4]], {}),
    "aten.avg_pool1d.default": lambda: ([_meta(2, 3, 8), [2]], {}),
    "aten.avg_pool2d_backward.default": lambda: (
        [_image(2, 2), _image(4, 4), [2, 2], [2, 2], [0, 0], False, True, None], {}),
    "aten.avg_pool3d.default": lambda: ([_image(4, 4, 4), [2, 2, 2]], {}),
    "aten.clamp.Tensor": lambda: ([_meta(4, 4), _meta(4, 4), _meta(4)], {}),
    "aten.clamp.default": lambda: ([_meta(4, 4), -0.5, 0.5], {}),
    "aten.col2im.default": lambda: (
        [_meta(2, 12, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]], {}),
    "aten.convolution.default": lambda: (
        [_image(8, 8), _meta(4, 3, 3, 3), _meta(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1], {}),
    "aten.convolution_backward.default": lambda: (
        [_meta(2, 4, 8, 8), _image(8, 8), _meta(4, 3, 3, 3), [4], [1, 1], [1, 1], [1, 1], False,
         [0, 0], 1, _NORM_MASK], {}),
    "aten.div.Scalar_mode": lambda: ([_ids(4, 4), 3], {"rounding_mode": "floor"}),
    "aten.div.Tensor_mode": lambda: ([_ids(4, 4), _ids(4, 4)], {"rounding_mode": "trunc"}),
    "aten.embedding_dense_backward.default": lambda: ([_meta(4, 3), _ids(4), 10, -1, False], {}),
    "aten.grid_sampler_2d.default": lambda: ([_image(4, 4), _meta(2, 3, 3, 2), 0, 0, False], {}),
    "aten.max_pool2d_with_indices_backward.default": lambda: (
        [_image(2, 2), _image(4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, _ids(2, 3, 2, 2)], {}),
    "aten.max_pool3d_with_indices.default": lambda: ([_image(4, 4, 4), [2, 2, 2]], {}),
    "aten.native_group_norm.default": lambda: (
        [_meta(2, 4, 4, 4), _meta(4), _meta(4), 2, 4, 16, 2, 1e-5], {}),
    "aten.native_group_norm_backward.default": lambda: (
        [_meta(2, 4, 4, 4), _meta(2, 4, 4, 4), _meta(2, 2), _meta(2, 2), _meta(4), 2, 4, 16, 2,
         _NORM_MASK], {}),
    "aten.native_layer_norm.default": lambda: ([_meta(2, 4, 4), [4], _meta(4), _meta(4), 1e-5], {}),
    "aten.native_layer_norm_backward.default": lambda: (
        [_meta(2, 4, 4), _meta(2, 4, 4), [4], _meta(2, 4, 1), _meta(2, 4, 1), _meta(4), _meta(4),
         _NORM_MASK], {}),
    "aten.nonzero.default": lambda: ([_held(4, 4)], {}),
    "aten.reflection_pad2d.default": lambda: ([_image(4, 4), [1, 1, 1, 1]], {}),
    "aten.reflection_pad3d.default": lambda: ([_image(4, 4, 4), [1] * 6], {}),
    "aten.replication_pad2d.default": lambda: ([_image(4, 4), [1, 1, 1, 1]], {}),
    "aten.replication_pad3d.default": lambda: ([_image(4, 4, 4), [1] * 6], {}),
    "aten.split_with_sizes.default": lambda: ([_meta(4, 4), [1, 3]], {}),
    "aten.upsample_bilinear2d.vec": lambda: ([_image(4, 4), [8, 8], False, None], {}),
    "aten.upsample_nearest2d.vec": lambda: ([_image(4, 4), [8, 8], None], {}),
}


def sample(overload: str) -> Sample | None:
    """The arguments listed for `overload`, or None (build them from its schema)."""
    make: Callable[[], Any] | None = SAMPLES.get(overload)
    return make() if make is not None else None
