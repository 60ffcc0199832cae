"""Expert-parallel Mixtral ranks: HF's parameter names, each rank's share of the experts."""
from __future__ import annotations

import pytest

from scalify.errors import ConfigError
from scalify.models import PRESETS, build_reference, make_hf_config
from scalify.parallel.experts import AllToAllExperts, expert_parallel_rank, expert_placements
from scalify.parallel.experts_planted import (LocalTopKRouter, WeightsTwiceExperts,
                                              WrongSplitsAllToAllExperts)
from scalify.placements import Replicate, Shard


@pytest.fixture
def config():
    return make_hf_config("mixtral", {**PRESETS["mixtral-tiny"].config, "num_hidden_layers": 1})


def test_rank_holds_its_slice_of_the_fused_expert_weights(config):
    rank = expert_parallel_rank(config, 1, 2)
    reference = dict(build_reference("mixtral", config).named_parameters())
    local = dict(rank.named_parameters())
    assert set(local) == set(reference)
    experts = rank.model.layers[0].mlp.experts
    assert experts.first_expert == 2 and experts.local_experts == 2
    assert local["model.layers.0.mlp.experts.gate_up_proj"].shape == (2, 256, 64)
    assert local["model.layers.0.mlp.gate.weight"].shape == reference["model.layers.0.mlp.gate.weight"].shape


def test_expert_weights_are_shard_0_and_the_rest_replicated(config):
    placements = expert_placements(config, 2)
    assert placements["model.layers.0.mlp.experts.down_proj"] == Shard(0)
    assert placements["model.layers.0.mlp.gate.weight"] == Replicate()
    assert placements["model.embed_tokens.weight"] == Replicate()


def test_planted_bugs_swap_one_module(config):
    assert isinstance(expert_parallel_rank(config, 0, 2, "ep-combine-weights-twice")
                      .model.layers[0].mlp.experts, WeightsTwiceExperts)
    assert isinstance(expert_parallel_rank(config, 0, 2, "ep-topk-local-experts")
                      .model.layers[0].mlp.gate, LocalTopKRouter)
    with pytest.raises(ConfigError, match="unknown expert-parallel planted bug"):
        expert_parallel_rank(config, 0, 2, "missing-allreduce")


def test_all_to_all_dispatch_keeps_the_same_parameters(config):
    rank = expert_parallel_rank(config, 0, 2, dispatch="all_to_all")
    assert isinstance(rank.model.layers[0].mlp.experts, AllToAllExperts)
    assert ({n: p.shape for n, p in rank.named_parameters()}
            == {n: p.shape for n, p in expert_parallel_rank(config, 0, 2).named_parameters()})
    assert isinstance(expert_parallel_rank(config, 0, 2, "ep-wrong-split-sizes", "all_to_all")
                      .model.layers[0].mlp.experts, WrongSplitsAllToAllExperts)


def test_a_planted_bug_needs_the_dispatch_it_lives_in(config):
    with pytest.raises(ConfigError, match="set plan.expert_dispatch"):
        expert_parallel_rank(config, 0, 2, "ep-wrong-split-sizes")
