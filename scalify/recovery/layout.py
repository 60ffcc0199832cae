"""How a flat parameter vector is cut into blocks, and which server shard holds each block."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Layout:
    """`size` parameters in `blocks` contiguous blocks, dealt round-robin to `shards` shards
    (as a key-hashing parameter server spreads keys)."""

    size: int
    blocks: int
    shards: int

    @cached_property
    def slices(self) -> list[slice]:
        bounds = np.linspace(0, self.size, self.blocks + 1).astype(int)
        return [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def shard_blocks(self, shard: int) -> list[int]:
        """The blocks shard `shard` holds."""
        return list(range(shard, self.blocks, self.shards))

    def split(self, params: np.ndarray) -> dict[int, np.ndarray]:
        """Each block's values."""
        return {block: params[where] for block, where in enumerate(self.slices)}

    def block_norms(self, values: np.ndarray) -> np.ndarray:
        """The Euclidean norm of `values` on each block."""
        return np.array([np.linalg.norm(values[where]) for where in self.slices])
