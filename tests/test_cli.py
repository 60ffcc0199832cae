"""The command line: exit codes, one-line errors, and the JSON/HTML reports."""
import json

import pytest

from scalify.cli import main


def test_verified_config_exits_zero_and_writes_reports(tmp_path):
    report_json, report_html = tmp_path / "r.json", tmp_path / "r.html"
    code = main(["verify", "configs/experiments/llama-tiny-tp2.yaml", "--numeric",
                 "--json", str(report_json), "--html", str(report_html)])
    assert code == 0
    assert json.loads(report_json.read_text())["verdict"] == "verified"
    assert 'id="verdict">verified' in report_html.read_text()


def test_planted_bug_exits_one_and_html_names_the_line(tmp_path):
    report_html = tmp_path / "r.html"
    code = main(["verify", "configs/experiments/llama-tiny-tp2-missing-allreduce.yaml",
                 "--html", str(report_html)])
    assert code == 1
    assert "planted: missing-allreduce" in report_html.read_text()


@pytest.mark.parametrize("text,fragment,file", [
    ("model: [unclosed\n", "malformed YAML", "bad.yaml"),
    ("model: llama-tiny\nplan: megatron-tp2\nhardware: gpu-2\nverifyy: {}\n", "verifyy: unknown key",
     "bad.yaml"),
    ("model: llama-tiny\nplan: megatron-tp2\nhardware: gpu-4\n", "hardware.devices", "gpu-4.yaml"),
])
def test_bad_config_is_one_line_and_exit_two(tmp_path, capsys, text, fragment, file):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["verify", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert fragment in error and file in error and "\n" not in error


