"""A sharding function's tensors followed as views, concatenations and fills on meta tensors:
the same pieces as index tensors give, at no cost in the reference's size."""
import functools

import pytest
import torch

from scalify.capture.shard_fn import _Indexed, _pieces, infer_placements
from scalify.capture.shard_values import Unfollowed, ValueTracker
from scalify.errors import ShapeError
from scalify.frameworks.megatron_core import hf_to_megatron
from scalify.models import build_reference, make_hf_config
from scalify.models.presets import PRESETS
from scalify.parallel.sharding import shard_fused_llama
from scalify.placements import Replicate, Shard


def _both_ways(shard, state, world):
    indexed = _Indexed.of(state)
    return (_pieces(shard, indexed, world, followed=True),
            _pieces(shard, indexed, world, followed=False))


def _llama(preset: str):
    config = make_hf_config("llama", {**PRESETS[preset].config, "num_hidden_layers": 1})
    return config, dict(build_reference("llama", config).named_parameters())


@pytest.mark.parametrize("preset,tp", [("llama-tiny", 2), ("llama-tiny-gqa", 2), ("llama-tiny", 4)])
def test_interleaved_qkv_reads_as_index_tensors_read_it(preset, tp):
    """Megatron's q|k|v per kv group: a concatenation, cut along another dim, then merged."""
    config, state = _llama(preset)
    followed, indexed = _both_ways(hf_to_megatron(config), state, tp)
    assert followed == indexed


def test_fused_qkv_with_kv_heads_repeated_reads_as_index_tensors_read_it():
    config, state = _llama("llama-tiny-gqa")
    followed, indexed = _both_ways(functools.partial(shard_fused_llama, config=config), state, 4)
    assert followed == indexed


def test_a_write_into_a_padded_buffer_lands_in_its_rows():
    def shard(state, rank, world_size):
        padded = state["emb"].new_zeros(8, 2)
        padded[:5] = state["emb"]
        return {"emb": padded.chunk(world_size)[rank].clone()}

    followed, indexed = _both_ways(shard, {"emb": torch.empty(5, 2, device="meta")}, 2)
    assert followed == indexed


def test_a_view_read_after_a_write_into_its_base_is_not_followed():
    """`head` would still show the old rows: the reading falls back to index tensors."""
    def shard(state, rank, world_size):
        buffer = state["w"].clone()
        head = buffer[:2]
        buffer.zero_()
        return {"w": head}

    with pytest.raises(Unfollowed):
        _pieces(shard, _Indexed.of({"w": torch.empty(4, 2, device="meta")}), 1, followed=True)
    with pytest.raises(ShapeError, match="w: the sharding function gives no rank any part"):
        infer_placements(shard, {"w": torch.empty(4, 2, device="meta")}, 1)  # (zeros: filler)


def test_a_transpose_copied_by_reshape_is_not_followed():
    tracker = ValueTracker()
    indexed = _Indexed.of({"w": torch.empty(4, 6, device="meta")})
    tensors = indexed.meta_tensors(tracker)
    tracker.track("t", (tensors["w"],), {}, out := tensors["w"].t())
    with pytest.raises(Unfollowed, match="aten.view: view size is not compatible"):
        tracker.track("view", (out, [24]), {}, torch.empty(24, device="meta"))


def test_a_405b_sized_embedding_is_read_without_materializing_it():
    """128,256 x 16,384 elements: 16.8 GB as index tensors."""
    state = {"embed": torch.empty(128256, 16384, device="meta"),
             "norm": torch.empty(16384, device="meta")}

    def shard(state, rank, world_size):
        return {"embed": state["embed"].chunk(world_size, 0)[rank].clone(), "norm": state["norm"]}

    assert infer_placements(shard, state, 8) == {"embed": Shard(0), "norm": Replicate()}


def test_an_unfollowed_op_on_a_huge_reference_is_a_clear_error():
    def shard(state, rank, world_size):
        rows = torch.arange(rank, 128256, world_size)
        return {"embed": state["embed"][rows]}

    with pytest.raises(ShapeError, match="too large to read it on index tensors"):
        infer_placements(shard, {"embed": torch.empty(128256, 16384, device="meta")}, 8)
