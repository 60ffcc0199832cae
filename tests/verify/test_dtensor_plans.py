"""HuggingFace Llama parallelised by torch DTensor plans verifies; planted plan and code bugs are caught."""
from pathlib import Path

import pytest
import yaml

import scalify
from scalify.config import REPO_CONFIGS
from scalify.errors import CaptureError, ConfigError
from scalify.parallel import dtensor_planted

SOURCE = Path(dtensor_planted.__file__).read_text().splitlines()
SEQUENCE_PARALLEL = yaml.safe_load((REPO_CONFIGS / "plans" / "dtensor-sp-tp2.yaml").read_text())["dtensor_plan"]
VOCAB_PARALLEL = {"model.embed_tokens": "embedding_rowwise", "model.layers.*.self_attn.q_proj": "colwise",
                  "model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise",
                  "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
                  "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
                  "lm_head": "colwise"}


def experiment(plan, tp: int = 2, *, bug: str | None = None, rank_symmetry: bool = True,
               layers: int = 1) -> dict:
    return {"model": "llama-tiny",
            "plan": {"style": "dtensor", "tensor_parallel": tp, "dtensor_plan": plan, "planted_bug": bug},
            "hardware": {"name": f"gpu-{tp}", "target": "gpu", "devices": tp},
            "inputs": {"batch": 1, "seq": 8}, "overrides": {"model.num_hidden_layers": layers},
            "verify": {"rank_symmetry": rank_symmetry}}


CORRECT = {"hf-tp2": ("hf", 2, True), "hf-tp2-per-rank": ("hf", 2, False), "hf-tp4": ("hf", 4, True),
           "vocab-parallel-tp2": (VOCAB_PARALLEL, 2, True),
           "sequence-parallel-tp2": (SEQUENCE_PARALLEL, 2, True),
           "sequence-parallel-tp2-per-rank": (SEQUENCE_PARALLEL, 2, False),
           "sequence-parallel-tp4": (SEQUENCE_PARALLEL, 4, True)}


@pytest.mark.parametrize("plan,tp,symmetry", CORRECT.values(), ids=CORRECT.keys())
def test_correct_dtensor_plan_verifies_and_the_numbers_agree(plan, tp, symmetry):
    report = scalify.verify(experiment(plan, tp, rank_symmetry=symmetry), numeric=True)
    assert report.verdict == "verified", [d.hint for d in report.discrepancies]
    assert report.numeric["agrees"], report.numeric
    assert report.stats["rank_symmetry"] == ("used" if symmetry else "off")


def test_the_shipped_experiment_verifies_two_layers_with_layer_reuse():
    config = REPO_CONFIGS / "experiments" / "llama-tiny-dtensor-tp2.yaml"
    report = scalify.verify(config)
    assert report.verified and report.numeric["agrees"]
    assert report.stats["layer_memo_hits"] == 1


def planted_line(bug: str) -> int:
    lines = [n for n, text in enumerate(SOURCE, 1) if f"# planted: {bug}" in text]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.parametrize("symmetry", [True, False], ids=["one-program", "per-rank"])
def test_global_heads_reshape_after_local_output_is_caught_at_its_line(symmetry):
    bug = "dtensor-global-heads-reshape"
    report = scalify.verify(experiment("hf", bug=bug, rank_symmetry=symmetry), numeric=True)
    assert report.verdict == "discrepancy"
    assert not report.numeric["agrees"], "the bug must change the numbers"
    assert (dtensor_planted.__file__, planted_line(bug)) in report.discrepancies[0].lines()


def test_a_norm_left_out_of_sequence_parallel_fails_at_that_norm():
    """The residual stream is a DTensor; the left-out norm's weight is a plain tensor, and
    DTensor refuses to mix them (forward would otherwise be unchanged: the norm is per token)."""
    with pytest.raises(CaptureError, match=r"^model\.layers\.0\.post_attention_layernorm at .*"
                                           r"modeling_llama\.py:\d+: .*mixed torch\.Tensor and DTensor"):
        scalify.verify(experiment(SEQUENCE_PARALLEL, bug="dtensor-norm-not-sequence-parallel"))


TRAINING = {"hf-tp2": ("hf", 2), "sequence-parallel-tp2": (SEQUENCE_PARALLEL, 2)}


@pytest.mark.parametrize("plan,tp", TRAINING.values(), ids=TRAINING.keys())
def test_training_step_of_a_dtensor_plan_verifies(plan, tp):
    """Loss and every parameter's gradient, the gradients redistributed to their parameters'
    layouts (partial sums of replicated norms all-reduced) as an optimizer step reads them."""
    config = experiment(plan, tp)
    config["verify"]["backward"] = True
    report = scalify.verify(config, numeric=True)
    assert report.verdict == "verified", [d.hint for d in report.discrepancies]
    assert report.numeric["agrees"], report.numeric


def test_training_step_with_vocab_sharded_logits_is_refused_with_the_reason():
    config = experiment(VOCAB_PARALLEL, 2)
    config["verify"]["backward"] = True
    with pytest.raises(ConfigError, match="replicated logits"):
        scalify.verify(config)
