"""A checkpoint sharding function states the relations: infer_placements reads them back."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import scalify
from scalify.capture.shard_fn import infer_placements
from scalify.errors import CaptureError, ShapeError
from scalify.models import build_reference, make_hf_config
from scalify.models.presets import PRESETS
from scalify.parallel import param_placements
from scalify.parallel.sharding import shard_fused_llama, shard_megatron_gpt2, shard_megatron_llama
from scalify.placements import Custom, Piece, Replicate, Shard, slabbed


def _model(preset: str, **fields):
    family = PRESETS[preset].family
    layers = {"num_hidden_layers": 1} if family == "llama" else {"n_layer": 1}
    config = make_hf_config(family, {**PRESETS[preset].config, **layers, **fields})
    reference = build_reference(family, config)
    state = {**dict(reference.named_parameters(remove_duplicate=False)),
             **dict(reference.named_buffers())}
    return family, config, state


@pytest.mark.parametrize("preset,tp", [("llama-tiny", 2), ("llama-tiny-gqa", 4), ("gpt2-tiny", 2)],
                         ids=["llama-tp2", "llama-gqa-tp4-replicated-kv", "gpt2-tp2-fused-c_attn"])
def test_inferred_placements_equal_the_hand_stated_ones(preset, tp):
    family, config, state = _model(preset)
    shard = (functools.partial(shard_megatron_llama, config=config) if family == "llama"
             else shard_megatron_gpt2)
    assert infer_placements(shard, state, tp) == param_placements(family, config, tp)


def test_fused_qkv_relates_to_q_k_and_v_with_kv_heads_replicated():
    """8 q heads, 2 kv heads, TP=4, head_dim 8: rank r holds [q heads 2r, 2r+1; k_g; v_g] for
    g = r // 2, so k_proj rows 0:8 are on ranks 0 and 1, rows 8:16 on ranks 2 and 3."""
    _, config, state = _model("llama-tiny-gqa")
    inferred = infer_placements(functools.partial(shard_fused_llama, config=config), state, 4)
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    assert inferred["model.layers.0.self_attn.q_proj.weight"].pieces == tuple(
        Piece(r, qkv, 0, 16 * r, 16) for r in range(4))
    assert inferred["model.layers.0.self_attn.k_proj.weight"].pieces == tuple(
        Piece(r, qkv, 16, 8 * (r // 2), 8) for r in range(4))
    assert inferred["model.layers.0.mlp.up_proj.weight"] == Custom(0, tuple(
        Piece(r, gate_up, 32, 32 * r, 32) for r in range(4)))
    assert inferred["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
    assert inferred["model.norm.weight"] == Replicate()


def test_a_gap_names_the_parameter_and_the_rows_no_rank_holds():
    def shard(state, rank, world_size):
        return {name: t[: t.shape[0] // world_size - 1] if name == "w" else t
                for name, t in state.items()} if rank == 0 else {"w": state["w"][4:]}

    with pytest.raises(ShapeError, match=r"w: indices \[3:4\) of dim 0 are held by no rank"):
        infer_placements(shard, {"w": torch.empty(8, 2, device="meta")}, 2)


def test_a_buffer_no_rank_is_given_keeps_the_default_but_a_parameter_is_an_error():
    def shard(state, rank, world_size):  # each rank builds its own rotary table
        return {"w": state["w"].chunk(world_size)[rank]}

    state = {"w": torch.empty(4, 2, device="meta"), "cos": torch.empty(8, 2, device="meta")}
    assert infer_placements(shard, state, 2, unmapped={"cos"}) == {"w": Shard(0)}
    with pytest.raises(ShapeError, match="cos: the sharding function gives no rank any part of it"):
        infer_placements(shard, state, 2)


def test_arithmetic_is_refused_with_its_line():
    def shard(state, rank, world_size):
        return {"w": state["w"] * 2}

    with pytest.raises(CaptureError, match=r"aten.mul at .*test_shard_fn.py:\d+ .* is not data movement"):
        infer_placements(shard, {"w": torch.empty(4, device="meta")}, 2)


def test_casts_are_ignored_and_the_cut_line_is_recorded():
    def shard(state, rank, world_size):
        return {"w": state["w"].to(torch.bfloat16).chunk(world_size, 1)[rank]}

    placement = infer_placements(shard, {"w": torch.empty(2, 6, device="meta")}, 3)["w"]
    assert placement == Shard(1)
    assert placement.declared_at.endswith(f"test_shard_fn.py:{shard.__code__.co_firstlineno + 1}")


HIDDEN, FFN, WORLD = 8, 16, 2


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class FusedParallelMLP(nn.Module):
    """The user's rank module: one gate_up weight [gate_r; up_r] and a row-parallel down."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN // WORLD, bias=False)
        self.down = nn.Linear(FFN // WORLD, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return funcol.all_reduce(self.down(F.silu(gate) * up), "sum", dist.group.WORLD)


def shard_mlp(state, rank, world_size):
    """The user's checkpoint converter."""
    gate, up = state["gate.weight"].chunk(world_size)[rank], state["up.weight"].chunk(world_size)[rank]
    return {"gate_up.weight": torch.cat([gate, up]),
            "down.weight": state["down.weight"].chunk(world_size, 1)[rank]}


def test_verify_modules_with_a_shard_function():
    with torch.device("meta"):
        reference = MLP()
    report = scalify.verify_modules(
        reference, lambda rank: FusedParallelMLP().to("meta"), WORLD,
        {"x": torch.empty(2, 4, HIDDEN, device="meta")}, shard_fn=shard_mlp, numeric=True)
    assert report.verified and report.numeric["agrees"], [d.hint for d in report.discrepancies]


def test_padding_rows_are_filler_not_pieces():
    """A vocab padded to a multiple of the ranks: the zero rows belong to no reference row."""
    def shard(state, rank, world_size):
        padded = torch.cat([state["emb"], torch.zeros(1, 2, dtype=state["emb"].dtype)])
        return {"emb": padded.chunk(world_size)[rank]}

    placement = infer_placements(shard, {"emb": torch.empty(5, 2, device="meta")}, 2)["emb"]
    assert placement == Custom(0, (Piece(0, "emb", 0, 0, 3), Piece(1, "emb", 0, 3, 2)))


def test_experts_stacked_into_one_tensor_are_read_slab_by_slab():
    def shard(state, rank, world_size):  # vLLM's FusedMoE w13: this rank's rows of w1 and w3
        return {"w13": torch.stack([torch.cat([state[f"{e}.w1"].chunk(world_size)[rank],
                                               state[f"{e}.w3"].chunk(world_size)[rank]])
                                    for e in range(2)])}

    state = {f"{e}.{w}": torch.empty(4, 3, device="meta") for e in range(2) for w in ("w1", "w3")}
    placements = infer_placements(shard, state, 2)
    assert placements["1.w3"].pieces == (Piece(0, "w13@1", 2, 0, 2), Piece(1, "w13@1", 2, 2, 2))
    assert slabbed(placements) == {"w13"}
