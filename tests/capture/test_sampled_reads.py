"""Reads of a program's data into Python (an MoE router's token counts) are sampled on real
numbers and replayed at capture; what is proved then holds for that routing only."""
from pathlib import Path

import pytest
import torch
from torch import nn

import scalify
from scalify.capture.sampled_reads import ReadLog
from scalify.capture.tracer import capture
from scalify.errors import DataDependentRead
from tests.corpus.cases import load

CORPUS = Path(__file__).resolve().parents[1] / "corpus"


class _CountsRouted(nn.Module):
    """Splits its rows by how many are positive: a shape read from the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = int((x[:, 0] > 0).sum())  # the read
        first, rest = x.split([positive, x.shape[0] - positive])
        return torch.cat([first * 2, rest], 0)


def test_a_read_of_the_data_is_refused_without_a_sample() -> None:
    x = torch.empty(4, 3, device="meta")
    with pytest.raises(DataDependentRead, match="read into Python"):
        capture(_CountsRouted(), lambda: _CountsRouted()(x), {"x": x})


def test_a_replayed_read_is_a_literal_and_its_line_a_condition_of_the_graph() -> None:
    x = torch.empty(4, 3, device="meta")
    module, log = _CountsRouted(), ReadLog()
    line = (__file__, next(number for number, text in enumerate(open(__file__), 1)
                           if text.rstrip().endswith("# the read")))
    log.add(line, "scalar", 3)
    graph = capture(module, lambda: module(x), {"x": x}, replay=log)
    assert graph.sampled_reads == (f"{line[0]}:{line[1]}",)
    assert [n.shape for n in graph if n.op == "mul_scalar"] == [(3, 3)]


def _verify(name: str) -> scalify.Report:
    case = load(CORPUS / name)
    module = case.module
    return scalify.verify_modules(
        reference=module.reference(),
        rank_module_factory=lambda rank: module.rank_module(rank, case.world_size),
        world_size=case.world_size, example_inputs=case.example_inputs(),
        param_placements=case.attr("PARAM_PLACEMENTS"), shard_fn=case.attr("shard"),
        input_placements=case.attr("INPUT_PLACEMENTS", {}),
        output_placements=list(module.OUTPUT_PLACEMENTS), grad=case.step == "training")


def test_expert_parallel_dispatch_by_token_counts_holds_for_the_sampled_routing_only() -> None:
    report = _verify("torch_distributed/moe_expert_parallel_all_to_all.py")
    assert report.verdict == "unknown" and not report.discrepancies
    assert report.numeric["agrees"] and report.numeric["inputs"] == "the sampled run's"
    assert "proved only for inputs the programs read as a sampled run did" in report.unknown[-1]
    assert "moe_expert_parallel_all_to_all.py:54" in report.unknown[-1]  # the split sizes


def test_fused_experts_stacked_by_the_weight_loader_hold_for_the_sampled_routing() -> None:
    report = _verify("vllm/mixtral_fused_moe_tp.py")  # w13 stacks every expert's w1 and w3 rows
    assert report.verdict == "unknown" and report.numeric["agrees"]


@pytest.mark.parametrize("name", ["torch_distributed/moe_expert_parallel_all_to_all_wrong_local_expert.py",
                                  "megatron_core/moe_alltoall_dispatch_sort_splits_transposed.py",
                                  "vllm/mixtral_fused_moe_tp_double_reduce.py"])
def test_a_dispatch_bug_under_the_sampled_routing_is_a_discrepancy(name: str) -> None:
    report = _verify(name)
    assert report.verdict == "discrepancy"
    assert report.numeric["agrees"] is False
