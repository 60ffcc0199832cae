"""torchtitan's own Llama 3 as a subject: parallelised by its own `parallelize` inside each
rank's fake process group (Scalify builds its ParallelDims and device mesh), against the same
model on one device."""
import pytest

import scalify
from scalify.config import REPO_CONFIGS

TP2_SP = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-tp2.yaml"
TP2 = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-tp2-no-sp.yaml"
TP2_GQA = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-gqa-tp2.yaml"
SPMD_TYPES = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-gqa-tp2-spmd-types.yaml"
LOSS = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-loss-tp2.yaml"
STEP = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-step-tp2.yaml"
STEP_SPMD_TYPES = REPO_CONFIGS / "experiments" / "torchtitan-llama-tiny-step-tp2-spmd-types.yaml"


@pytest.mark.parametrize("config", [TP2_SP, TP2, TP2_GQA, SPMD_TYPES, LOSS, STEP, STEP_SPMD_TYPES],
                         ids=["TP2 with sequence parallelism", "TP2 without SP",
                              "TP2, one kv head group per rank", "TP2 on the spmd_types backend",
                              "its loss with loss parallel", "a training step",
                              "a training step on the spmd_types backend"])
def test_llama3_verifies_against_itself_on_one_device(config):
    report = scalify.verify(config)
    assert report.numeric["agrees"]
    assert report.verdict == "verified", report.discrepancies[:1]


SCALED_BIAS = REPO_CONFIGS / "experiments" / "torchtitan-bug-scaled-row-bias-gradient.yaml"
SCALED_BIAS_FIX = REPO_CONFIGS / "experiments" / "torchtitan-fix-scaled-row-bias-gradient.yaml"
NO_SOFTMAX = REPO_CONFIGS / "experiments" / "torchtitan-bug-loss-parallel-backward-without-softmax.yaml"
IGNORED = REPO_CONFIGS / "experiments" / "torchtitan-bug-loss-parallel-backward-ignored-labels.yaml"


def _first_lines(report: scalify.Report, file_ending: str) -> set[int]:
    return {line for file, line in report.discrepancies[0].lines() if file.endswith(file_ending)}


def test_the_released_row_parallel_bias_gradient_is_caught_and_its_proposed_fix_verifies():
    """torchtitan#4332 in torchtitan 0.3.0 as released: ScaledBiasRowwiseLinear adds
    `bias / tp` with a differentiable division, so each rank's bias gradient is 1/tp of the
    reference's. Caught at wo's bias gradient, the division's line named; the fix the pull
    request proposes, patched in at capture, verifies."""
    report = scalify.verify(SCALED_BIAS)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    assert 70 in _first_lines(report, "torchtitan/models/common/linear.py")  # bias / tp_degree
    fixed = scalify.verify(SCALED_BIAS_FIX)
    assert fixed.numeric["agrees"]
    assert fixed.verdict == "verified", fixed.discrepancies[:1]


@pytest.mark.parametrize("config, line", [(NO_SOFTMAX, 219), (IGNORED, None)],
                         ids=["softmax term dropped", "ignored labels' gradient kept"])
def test_a_fault_patched_into_the_loss_parallel_backward_is_caught_there(config, line):
    """Faults planted in torchtitan's `_LossParallelCrossEntropy.backward` (plan.patches):
    its softmax term dropped (the symptom of pytorch#190746) is blamed on the patched line; the
    ignore mask deleted is caught in the same backward (the deleted fill has no line)."""
    report = scalify.verify(config)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    [(module, patched)] = report.stats["patched"].items()
    assert module == "torchtitan.components.loss"
    first = report.discrepancies[0]
    assert first.dist_source.file == patched.split(" (")[0] and first.dist_source.backward
    assert 195 <= first.dist_source.line <= 220  # the backward
    if line is not None:
        assert first.dist_source.line == line
