"""Checkpoint sharding functions of the built-in rank models: `shard(reference_state, rank,
world_size, *, config) -> rank_state`, written as a checkpoint converter would write them.

They state the same relations as the layers' `placements()`; `scalify.infer_placements` reads
the relations back out of them, and the fused layout states its relations only this way.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import LlamaConfig

from scalify.parallel.fused import head_layout
from scalify.parallel.llama import kv_head_of_rank

State = dict[str, torch.Tensor]
QKVRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, LlamaConfig], torch.Tensor]

_ROWS = ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_COLUMNS = ("o_proj", "down_proj")


def _module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else ""


def _kv_rows(tensor: torch.Tensor, rank: int, world_size: int, kv_heads: int) -> torch.Tensor:
    """This rank's kv heads; with fewer kv heads than ranks, the one head its query heads use."""
    if kv_heads >= world_size:
        return tensor.chunk(world_size, 0)[rank]
    heads = tensor.view(kv_heads, -1, *tensor.shape[1:])
    return heads[kv_head_of_rank(rank, world_size, kv_heads)]


def shard_megatron_llama(state: State, rank: int, world_size: int, *, config: LlamaConfig) -> State:
    """Megatron tensor parallelism: column-parallel rows, row-parallel columns, vocab rows."""
    out = {}
    for name, tensor in state.items():
        module = _module(name)
        if module in _ROWS:
            out[name] = tensor.chunk(world_size, 0)[rank]
        elif module in ("k_proj", "v_proj"):
            out[name] = _kv_rows(tensor, rank, world_size, config.num_key_value_heads)
        elif module in _COLUMNS and name.endswith(".weight"):
            out[name] = tensor.chunk(world_size, 1)[rank]
        else:
            out[name] = tensor
    return out


def fused_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world_size: int,
                   config: LlamaConfig) -> torch.Tensor:
    """Megatron's fused layout: for each kv group of this rank, its share of the group's query
    heads, then the group's k and v heads."""
    groups, _, sharing = head_layout(config, world_size)
    kv_heads = config.num_key_value_heads
    q_groups, k_groups, v_groups = (t.view(kv_heads, -1, *t.shape[1:]) for t in (q, k, v))
    first = rank // sharing * groups
    pieces = []
    for group in range(first, first + groups):
        pieces += [q_groups[group].chunk(sharing, 0)[rank % sharing], k_groups[group], v_groups[group]]
    return torch.cat(pieces)


def shard_fused_llama(state: State, rank: int, world_size: int, *, config: LlamaConfig,
                      qkv_rows: QKVRows = fused_qkv_rows) -> State:
    """Fused qkv_proj (`qkv_rows`) and gate_up_proj ([gate_r; up_r]); the rest as Megatron's."""
    fused = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    out = shard_megatron_llama({n: t for n, t in state.items() if _module(n) not in fused},
                               rank, world_size, config=config)
    for name, tensor in state.items():
        prefix, _, kind = name.rpartition(f".{_module(name)}.")
        if _module(name) == "q_proj":
            k, v = state[f"{prefix}.k_proj.{kind}"], state[f"{prefix}.v_proj.{kind}"]
            out[f"{prefix}.qkv_proj.{kind}"] = qkv_rows(tensor, k, v, rank, world_size, config)
        elif _module(name) == "gate_proj":
            up = state[f"{prefix}.up_proj.{kind}"]
            out[f"{prefix}.gate_up_proj.{kind}"] = torch.cat(
                [tensor.chunk(world_size, 0)[rank], up.chunk(world_size, 0)[rank]])
    return out


def shard_megatron_gpt2(state: State, rank: int, world_size: int) -> State:
    """Megatron GPT-2 (Conv1D weights are [in, out]): c_attn columns per [q|k|v] block, c_fc
    columns, c_proj rows, vocab rows."""
    out = {}
    for name, tensor in state.items():
        module = _module(name)
        if module == "c_attn":
            blocks = tensor.chunk(3, -1)
            out[name] = torch.cat([block.chunk(world_size, -1)[rank] for block in blocks], -1)
        elif module == "c_fc":
            out[name] = tensor.chunk(world_size, -1)[rank]
        elif module == "c_proj" and name.endswith(".weight"):
            out[name] = tensor.chunk(world_size, 0)[rank]
        elif module in ("wte", "lm_head"):
            out[name] = tensor.chunk(world_size, 0)[rank]
        else:
            out[name] = tensor
    return out
