"""Megatron-Core's own GPTModel as a subject: built per rank with its parallel state set up by
Scalify inside the fake process group, its weights mapped from the HuggingFace Llama's by name."""
import pytest
import torch

from scalify.capture.as_gpu import as_gpu
from scalify.capture.ranks import fake_process_group
from scalify.config import REPO_CONFIGS
from scalify.frameworks.megatron_core import hf_to_megatron, rank_model
from scalify.frameworks.megatron_core_plan import MegatronCorePlan
from scalify.models import build_reference, make_hf_config
from scalify.models.presets import PRESETS

CONFIG = REPO_CONFIGS / "experiments" / "megatron-core-llama-tiny-tp2.yaml"
GQA_CONFIG = REPO_CONFIGS / "experiments" / "megatron-core-llama-tiny-gqa-tp2.yaml"
TP4_CONFIG = REPO_CONFIGS / "experiments" / "megatron-core-llama-tiny-tp4.yaml"
LOSS_CONFIG = REPO_CONFIGS / "experiments" / "megatron-core-llama-tiny-loss-tp2.yaml"
PATCHED = REPO_CONFIGS / "experiments" / "megatron-core-bug-head-size-from-rank-share.yaml"
GATHERED_LOGITS = REPO_CONFIGS / "experiments" / "megatron-core-bug-gathered-logits-loss.yaml"


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


@pytest.mark.parametrize("config", [CONFIG, GQA_CONFIG, TP4_CONFIG, LOSS_CONFIG],
                         ids=["TP2, 8 kv heads", "TP2, 2 kv heads", "TP4",
                              "TP2 through the vocab-parallel loss"])
def test_gpt_model_verifies_against_the_huggingface_llama(config):
    import scalify

    report = scalify.verify(config)
    assert report.numeric["agrees"]
    assert report.verdict == "verified", report.discrepancies[:1]


def test_a_fault_patched_into_megatron_core_is_caught_in_the_patched_source():
    """plan.patches: the attention's head size taken from the rank's share of the projection
    (a softmax scale right only at TP=1), planted by a diff against the installed package; the
    report blames the patched copy's scores and names its lines that set the scale."""
    import scalify

    report = scalify.verify(PATCHED)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    [(module, patched)] = report.stats["patched"].items()
    copy = patched.split(" (")[0]
    assert module == "megatron.core.transformer.dot_product_attention"
    first = report.discrepancies[0]
    assert first.dist_source.file == copy
    assert (copy, 85) in first.lines()  # softmax_scale = 1 / sqrt(the patched head size)


def test_gathered_logits_fed_to_the_vocab_parallel_loss_are_caught():
    """Megatron-LM#7452 re-created by a patch: the output layer gathers the logits, and the
    vocab-parallel cross entropy reads each rank's whole copy as its vocabulary shard. Caught
    where the loss parts from the reference; the report names the output layer's gather (the
    patched argument is the call site one frame past the callers a report records)."""
    import scalify

    report = scalify.verify(GATHERED_LOGITS)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    [(module, _)] = report.stats["patched"].items()
    assert module == "megatron.core.models.gpt.gpt_model"
    first = report.discrepancies[0]
    assert first.dist_source.file.endswith("megatron/core/tensor_parallel/cross_entropy.py")
    assert any(file.endswith("megatron/core/tensor_parallel/mappings.py") and line == 94
               for file, line in first.lines())  # _gather_along_last_dim's concat
