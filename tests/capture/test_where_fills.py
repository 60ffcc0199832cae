"""A choice with a number on one side (`torch.where(mask, x, 0)`) is captured as the fill it
is: the other side filled where the condition fails, that failure spelled as the complementary
comparison (`ne` of a fill taken where `ne` holds is an `eq` fill), under the same broadcasts."""
import pytest
import torch
from torch import nn

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph


class Choice(nn.Module):
    def __init__(self, choose) -> None:
        super().__init__()
        self.choose = choose

    def forward(self, x, ids):
        return self.choose(x, ids)


CHOICES = {
    "number taken where the test fails": (lambda x, ids: torch.where(ids != 3, ids, 0), "eq_scalar"),
    "number taken where the test holds": (lambda x, ids: torch.where(ids < 2, 7, ids), "lt_scalar"),
    "test broadcast over rows": (
        lambda x, ids: torch.where((ids != 3).unsqueeze(-1), x, 0.0), "eq_scalar"),
    "negated test": (lambda x, ids: torch.where(~(ids > 4), ids, -1), "gt_scalar"),
}


@pytest.mark.parametrize("name", CHOICES)
def test_a_choice_with_a_number_is_a_fill_of_the_complement(name):
    choose, mask_op = CHOICES[name]
    inputs = {"x": torch.randn(2, 6, 3), "ids": torch.randint(0, 6, (2, 6))}
    module = Choice(choose)
    graph = capture(module, lambda: module(**inputs), inputs)
    ops = [node.op for node in graph]
    assert "where" not in ops and "masked_fill" in ops
    fill = next(node for node in graph if node.op == "masked_fill")
    mask = graph[fill.inputs[1]]
    while mask.op in ("unsqueeze", "expand"):
        mask = graph[mask.inputs[0]]
    assert mask.op == mask_op
    assert torch.equal(run_graph(graph, inputs)[graph.outputs[0]], choose(**inputs))


def test_a_choice_between_two_tensors_stays_a_choice():
    inputs = {"x": torch.randn(2, 6, 3), "ids": torch.randint(0, 6, (2, 6))}
    module = Choice(lambda x, ids: torch.where(x > 0, x, -x))
    graph = capture(module, lambda: module(**inputs), inputs)
    assert [node.op for node in graph].count("where") == 1
