"""The corpus harness selects cases by `style/name` or by path, says when none matches, and
reports a case whose proof outlives its deadline as unknown."""
import pytest

from .cases import ROOT, case_paths, load
from .verify_cases import run


def test_a_case_is_selected_by_name_or_by_a_relative_path(monkeypatch) -> None:
    by_name = case_paths(["vllm/mixtral_fused_moe_tp_double_reduce"])
    monkeypatch.chdir(ROOT.parent.parent)
    assert case_paths(["tests/corpus/vllm/mixtral_fused_moe_tp_double_reduce.py"]) == by_name


def test_a_selection_that_matches_no_case_is_an_error() -> None:
    with pytest.raises(SystemExit, match="no corpus case matches vllm/nothing"):
        case_paths(["vllm/nothing"])


def test_a_case_past_its_deadline_is_unknown_not_verified() -> None:
    case = load(case_paths(["dtensor/distribute_tensor_mlp"])[0])
    assert run(case).verdict == "verified"
    late = run(case, deadline_seconds=0.0)
    assert late.verdict == "unknown" and "deadline" in late.detail
