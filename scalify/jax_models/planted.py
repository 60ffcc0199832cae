"""Planted bugs in the Megatron `shard_map` block (jax_models/llama.py), one builder each; the
bug sits on the line its report must name. JAX's replication check (`check_vma`) would reject
the first two before any HLO exists, so they are built with it off, as a user silencing it."""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from .llama import (MEGATRON_SPECS, A, JaxProgram, attention, mlp, psum_tp, rms_norm,
                    shard_map_program)


def _without_mlp_psum(x: A, cos: A, sin: A, norm1: A, wq: A, wk: A, wv: A, wo: A, norm2: A,
                      w_gate: A, w_up: A, w_down: A) -> A:
    x = x + psum_tp(attention(rms_norm(x, norm1), cos, sin, wq, wk, wv, wo))
    return x + mlp(rms_norm(x, norm2), w_gate, w_up, w_down)  # BUG: the partial sum is not reduced


def _mlp_psum_over_dp(x: A, cos: A, sin: A, norm1: A, wq: A, wk: A, wv: A, wo: A, norm2: A,
                      w_gate: A, w_up: A, w_down: A) -> A:
    x = x + psum_tp(attention(rms_norm(x, norm1), cos, sin, wq, wk, wv, wo))
    return x + jax.lax.psum(mlp(rms_norm(x, norm2), w_gate, w_up, w_down), "dp")  # BUG: not "tp"


def missing_psum() -> JaxProgram:
    return shard_map_program(_without_mlp_psum, check_vma=False)


def psum_over_wrong_axis() -> JaxProgram:
    return shard_map_program(_mlp_psum_over_dp, check_vma=False)


def wq_sharded_on_head_dim() -> JaxProgram:
    """wq split over head_dim, not heads: the local shapes still fit, the columns do not."""
    wrong = P(None, None, "tp")
    return shard_map_program(in_specs=MEGATRON_SPECS[:4] + (wrong,) + MEGATRON_SPECS[5:])  # BUG

