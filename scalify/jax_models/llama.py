"""A tiny Llama decoder block in JAX (RMSNorm, rotary attention, SwiGLU MLP) and its
tensor-parallel versions: automatically partitioned from shardings, and Megatron-style with
`shard_map` and explicit `psum`. Builders return a `JaxProgram` (capture/jax_dump.py dumps it).

Weights are kept per head ([hidden, heads, head_dim], [heads, head_dim, hidden]) so that a
Megatron split over heads is a split of one dim. Every function here is written for local
shapes: the number of heads is read from the weights, so the same code runs whole or sharded.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

BATCH, SEQ, HIDDEN, HEADS, HEAD_DIM, FFN = 2, 8, 16, 4, 4, 32
EPS = 1e-5
A = jax.Array
Reduce = Callable[[A], A]


@dataclass(frozen=True)
class JaxProgram:
    """A single-device `reference` and its `distributed` version over `mesh`: a function of
    the global arrays `inputs`, jitted with `in_specs` / `out_specs` as its shardings;
    `specs_at` is the `file:line` that chose the specs (placements cite it)."""

    reference: Callable
    distributed: Callable
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    mesh: Mesh
    in_specs: tuple[P, ...]
    out_specs: P
    specs_at: str = ""


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of the first devices in id order, so that partition i is device i."""
    count = int(np.prod(shape))
    if count > len(jax.devices()):
        raise ValueError(f"a mesh of {count} devices, but JAX has {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


def block_inputs() -> tuple[jax.ShapeDtypeStruct, ...]:
    """x, the rotary tables cos and sin, then the weights in `block`'s order."""
    shapes = [(BATCH, SEQ, HIDDEN), (SEQ, HEAD_DIM), (SEQ, HEAD_DIM), (HIDDEN,),
              (HIDDEN, HEADS, HEAD_DIM), (HIDDEN, HEADS, HEAD_DIM), (HIDDEN, HEADS, HEAD_DIM),
              (HEADS, HEAD_DIM, HIDDEN), (HIDDEN,), (HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN)]
    return tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes)


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [batch, seq, heads, head_dim] rotated by position (tables [seq, head_dim])."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def project(h: jax.Array, weight: jax.Array) -> jax.Array:
    """h [batch, seq, hidden] through a per-head weight [hidden, heads, head_dim]."""
    flat = h @ weight.reshape(weight.shape[0], -1)
    return flat.reshape(*h.shape[:-1], -1, HEAD_DIM)


def attention(h: jax.Array, cos: jax.Array, sin: jax.Array, wq: jax.Array, wk: jax.Array,
              wv: jax.Array, wo: jax.Array) -> jax.Array:
    """Causal self-attention over the heads the weights hold; the output projection's partial
    sum over those heads (the caller reduces it across devices)."""
    q, k = rotary(project(h, wq), cos, sin), rotary(project(h, wk), cos, sin)
    v = project(h, wv)
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    context = jnp.einsum("bnqk,bknd->bqnd", weights, v)
    return context.reshape(*h.shape[:-1], -1) @ wo.reshape(-1, wo.shape[-1])


def mlp(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU over the columns the weights hold; a partial sum, as for attention."""
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def block(x: A, cos: A, sin: A, norm1: A, wq: A, wk: A, wv: A, wo: A, norm2: A, w_gate: A,
          w_up: A, w_down: A, *, reduce: Reduce = lambda t: t) -> A:
    """One decoder block; `reduce` completes the sublayers' partial sums (identity whole)."""
    x = x + reduce(attention(rms_norm(x, norm1), cos, sin, wq, wk, wv, wo))
    return x + reduce(mlp(rms_norm(x, norm2), w_gate, w_up, w_down))


def psum_tp(t: jax.Array) -> jax.Array:
    return jax.lax.psum(t, "tp")


def megatron_block(*args: jax.Array) -> jax.Array:
    """The block on one device's shards: each sublayer's partial sum reduced over 'tp'."""
    return block(*args, reduce=psum_tp)


# Megatron layout: heads and FFN columns split over 'tp', rows of the second matmuls too;
# the batch over 'dp'.
MEGATRON_SPECS = (P("dp"), P(), P(), P(), P(None, "tp"), P(None, "tp"), P(None, "tp"),
                  P("tp"), P(), P(None, "tp"), P(None, "tp"), P("tp"))
MESH_SHAPE, MESH_AXES = (2, 2), ("dp", "tp")


def shard_map_program(local: Callable = megatron_block, in_specs: tuple[P, ...] = MEGATRON_SPECS,
                      check_vma: bool = True) -> JaxProgram:
    """`local` (a block on one device's shards) run by `shard_map` over a (dp, tp) mesh; the
    specs are cited at the line that called this. `check_vma=False` turns off JAX's own check
    that outputs are replicated where out_specs say (it rejects a missing psum)."""
    mesh = make_mesh(MESH_SHAPE, MESH_AXES)
    distributed = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P("dp"),
                                check_vma=check_vma)
    caller = sys._getframe(1)
    return JaxProgram(block, distributed, block_inputs(), mesh, in_specs, P("dp"),
                      f"{caller.f_code.co_filename}:{caller.f_lineno}")


def auto_program() -> JaxProgram:
    """The reference block itself, partitioned by XLA from the Megatron shardings."""
    mesh = make_mesh(MESH_SHAPE, MESH_AXES)
    return JaxProgram(block, block, block_inputs(), mesh, MEGATRON_SPECS, P("dp"))
