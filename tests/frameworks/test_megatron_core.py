"""Megatron-Core's own GPTModel as a subject: built per rank with its parallel state set up by
Scalify inside the fake process group, its weights mapped from the HuggingFace Llama's by name.
Its experiments are cells of the framework matrix (tests/test_framework_matrix.py)."""
import pytest
import torch

from scalify.capture.as_gpu import as_gpu
from scalify.capture.ranks import fake_process_group
from scalify.frameworks.megatron_core import hf_to_megatron, rank_model
from scalify.frameworks.megatron_core_plan import MegatronCorePlan
from scalify.models import build_reference, make_hf_config
from scalify.models.presets import PRESETS


@pytest.mark.parametrize("world,kv_heads", [(2, 8), (2, 2), (4, 4)])
def test_the_name_map_gives_every_rank_parameter_its_shape(world, kv_heads):
    hf_config = make_hf_config("llama", dict(PRESETS["llama-tiny"].config,
                                             num_key_value_heads=kv_heads))
    reference = build_reference("llama", hf_config)
    state = {name: torch.zeros(t.shape) for name, t in reference.state_dict().items()}
    build = rank_model(hf_config, MegatronCorePlan(tensor_model_parallel_size=world))
    for rank in range(world):
        with fake_process_group(rank, world), as_gpu("meta"):  # as capture builds it
            held = {name: t.shape for name, t in build(rank).model.state_dict().items()
                    if not name.endswith("_extra_state")}
        mapped = hf_to_megatron(hf_config)(state, rank, world)
        assert {name: t.shape for name, t in mapped.items()} == held
