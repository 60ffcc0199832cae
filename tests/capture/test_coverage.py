"""The share of the core ATen opset the tracer lowers does not fall, and every overload is
measured by capturing a sample, not assumed from the tables."""
from scalify.capture.coverage import measure

LOWERED_AT_LEAST = 189  # of 191 core overloads (torch 2.13.0)
# Their values or shapes depend on the data, which a graph of fixed shapes cannot hold.
DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default"}


def test_core_aten_coverage_does_not_fall():
    coverage = measure()
    assert len(coverage.lowered) >= LOWERED_AT_LEAST, sorted(coverage.missing)
    assert set(coverage.missing) <= DATA_DEPENDENT and not coverage.unprobed
    assert "aten.max.dim" in coverage.lowered
    assert "uninterpreted" in coverage.lowered["aten.convolution.default"]
