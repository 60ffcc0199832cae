"""Stage(rank): a tensor only one rank holds, whole (pipeline stages' parameters and outputs)."""
import torch

from scalify.placements import Replicate, Stage
from scalify.verify.numeric import _assemble, _rank_value
from scalify.verify.relations import even_placements, output_holders, stage_relation


def test_a_stage_tensor_relates_to_its_one_rank():
    assert stage_relation("w", Stage(1), (2, 3), "r1/w", (2, 3)).term == '(dist "r1/w")'


def test_each_rank_returns_only_the_outputs_it_holds():
    # loss on the last stage, then a gradient on each stage, then a replicated value
    outputs = [Stage(1), Stage(0), Stage(1), Replicate()]
    assert output_holders(outputs, 0, 2) == [(1, 0)]
    assert output_holders(outputs, 1, 2) == [(0, 0)]
    assert output_holders(outputs, 2, 2) == [(1, 1)]
    assert output_holders(outputs, 3, 2) == [(0, 1), (1, 2)]


def test_numbers_give_the_holder_the_whole_tensor():
    full = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(_rank_value(full, Stage(1), 1, 2), full)
    assert _assemble([full], Stage(1)) == [full]


def test_stage_placements_take_the_per_rank_path():
    assert not even_placements({"w": Stage(0)}, 2)
