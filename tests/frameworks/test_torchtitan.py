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


@pytest.mark.parametrize("config", [TP2_SP, TP2, TP2_GQA, SPMD_TYPES],
                         ids=["TP2 with sequence parallelism", "TP2 without SP",
                              "TP2, one kv head group per rank", "TP2 on the spmd_types backend"])
def test_llama3_verifies_against_itself_on_one_device(config):
    report = scalify.verify(config)
    assert report.numeric["agrees"]
    assert report.verdict == "verified", report.discrepancies[:1]
