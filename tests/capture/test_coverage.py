"""The share of the core ATen opset the tracer lowers does not fall, and every overload is
measured by capturing a sample, not assumed from the tables."""
from scalify.capture.coverage import measure

CORE_OVERLOADS = 193  # torch 2.13.0: every aten op the dispatcher registers
# Their values or shapes depend on the data: captured by replaying a sampled run's reads.
DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default"}


def test_core_aten_coverage_does_not_fall():
    coverage = measure()
    assert len(coverage.lowered) == coverage.total >= CORE_OVERLOADS, sorted(coverage.missing)
    assert not coverage.unprobed
    assert all("sampled run" in coverage.lowered[name] for name in DATA_DEPENDENT)
    assert "aten.max.dim" in coverage.lowered
    assert "uninterpreted" in coverage.lowered["aten.convolution.default"]
