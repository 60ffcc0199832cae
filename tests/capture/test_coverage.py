"""The share of the core ATen opset the tracer lowers does not fall."""
from scalify.capture.coverage import measure

LOWERED_AT_LEAST = 159  # of 191 core overloads (torch 2.13.0)


def test_core_aten_coverage_does_not_fall():
    coverage = measure()
    assert len(coverage.lowered) >= LOWERED_AT_LEAST, sorted(coverage.missing)
    assert "aten.max.dim" in coverage.lowered and "aten.convolution.default" in coverage.missing
