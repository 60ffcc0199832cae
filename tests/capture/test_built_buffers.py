"""Buffers a module builds for itself (non-persistent: a rotary table) are constants of the
program, so a rank's table relates to the reference's by value whatever each is named; a
persistent buffer stays an input, and so does a built one too large (or too abstract) to write
into the program."""
import torch
from torch import nn

import scalify
from scalify.capture.tracer import LITERAL_ELEMENTS, capture

ROWS, DIM = 6, 4


def _table(rows: int = ROWS) -> torch.Tensor:
    return torch.arange(rows * DIM, dtype=torch.float32).reshape(rows, DIM).sin()


class Scaled(nn.Module):
    def __init__(self, persistent: bool = False, rows: int = ROWS) -> None:
        super().__init__()
        self.register_buffer("table", _table(rows), persistent=persistent)

    def forward(self, x):
        return x * self.table[: x.shape[0]]


class Holder(nn.Module):
    """The same table one module down, under another name."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        self.rope = nn.Module()
        self.rope.register_buffer("cache", _table() + shift, persistent=False)

    def forward(self, x):
        return x * self.rope.cache


def _placeholders(module: nn.Module) -> list[str]:
    x = {"x": torch.randn(ROWS, DIM)}
    graph = capture(module, lambda: module(**x), x)
    return [n.name for n in graph if n.op == "placeholder"]


def test_a_built_buffer_is_a_constant_and_a_persistent_one_an_input():
    assert "table" not in _placeholders(Scaled())
    assert "table" in _placeholders(Scaled(persistent=True))
    assert "table" in _placeholders(Scaled(rows=LITERAL_ELEMENTS // DIM + 1))


def _verify(shift: float):
    return scalify.verify_modules(
        reference=Scaled(), rank_module_factory=lambda rank: Holder(shift), world_size=2,
        example_inputs={"x": torch.randn(ROWS, DIM)}, output_placements=[scalify.Replicate()],
        numeric=True)


def test_a_rank_table_named_another_way_relates_by_value():
    report = _verify(0.0)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_a_rank_table_of_other_values_is_caught():
    report = _verify(0.5)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
