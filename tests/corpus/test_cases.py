"""The corpus harness selects cases by `style/name` or by path, says when none matches, and
reports a case whose proof outlives its deadline as unknown; cases verified at once are
reported in case order."""
import json
import subprocess
import sys

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


def test_cases_verified_at_once_are_reported_in_case_order(tmp_path) -> None:
    names = ["dtensor/distribute_tensor_mlp", "dtensor/distribute_tensor_mlp_wrong_shard_dim"]
    out = tmp_path / "corpus.json"
    subprocess.run([sys.executable, "-m", "tests.corpus.verify_cases", *names, "--jobs", "2",
                    "--json", str(out)], cwd=ROOT.parent.parent, check=True, timeout=600)
    outcomes = json.loads(out.read_text())
    assert [o["name"] for o in outcomes] == names
    assert [o["verdict"] for o in outcomes] == ["verified", "discrepancy"]
