"""The HTML report as a reader sees it: headless Chromium loads the page and dumps its DOM."""
import os
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest

from scalify.ir.graph import SourceLoc
from scalify.report.model import Discrepancy, Report
from scalify.report.render import to_html

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VOID_TAGS = {"meta", "br", "hr", "img", "input", "link"}

REFERENCE = SourceLoc("scalify/models/llama.py", 120, "return self.down_proj(x)", "model.layers.0.mlp")
BLAMED = SourceLoc("scalify/parallel/megatron.py", 88, "out = F.linear(x, self.weight)",
                   "model.layers.0.mlp", ("scalify/parallel/megatron.py:140",))
NEARBY = [BLAMED, SourceLoc("scalify/parallel/megatron.py", 91,
                            "return out if rank < 0 else out + self.bias", "model.layers.0.mlp")]
TIMINGS = {"capture_s": 1.23, "verify_s": 4.5}


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        reason = "chromium is not installed (`make browser` installs it)"
        if os.environ.get("SCALIFY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, and SCALIFY_REQUIRE_BROWSER=1")
        pytest.skip(reason)
    return path


class TextByClass(HTMLParser):
    """Collects the text inside every element, under each of the element's classes."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[list[str], list[str]]] = []  # (classes, text parts) per open element
        self.texts: dict[str, list[str]] = defaultdict(list)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in VOID_TAGS:
            self.open.append(((dict(attrs).get("class") or "").split(), []))

    def handle_endtag(self, tag: str) -> None:
        classes, parts = self.open.pop()
        text = "".join(parts)
        for name in classes:
            self.texts[name].append(text)
        if self.open:
            self.open[-1][1].append(text)

    def handle_data(self, data: str) -> None:
        if self.open:
            self.open[-1][1].append(data)


def browse(chromium: str, report: Report, tmp_path: Path) -> dict[str, list[str]]:
    """Renders the report, opens it in Chromium, and returns the DOM's text by class."""
    page = tmp_path / "report.html"
    to_html(report, page)
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
               "--dump-dom", page.as_uri()]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    parser = TextByClass()
    parser.feed(dom)
    return parser.texts


def test_discrepancy_page_shows_the_op_its_source_lines_and_the_relations(chromium, tmp_path):
    found = "Partial(sum) over ranks of mlp_down"
    expected = "a relation to the ranks' tensors (Replicate, Shard or Partial)"
    discrepancy = Discrepancy(
        "matmul", "mlp_down", "model.layers.0.mlp", REFERENCE, BLAMED, found=found,
        expected=expected, hint="an all_reduce is missing before this matmul", nearby=NEARBY)
    texts = browse(chromium, Report("llama-tiny-tp2", False, "discrepancy", [discrepancy],
                                    TIMINGS), tmp_path)

    assert texts["verdict"] == ["discrepancy"]
    assert texts["timings"] == ["capture1.23verify4.50"]
    assert "reference matmul (mlp_down)" in texts["discrepancy"][0]
    [reference] = texts["reference"]
    assert "scalify/models/llama.py:120" in reference and REFERENCE.code in reference
    [blamed] = texts["distributed"]
    assert "scalify/parallel/megatron.py:88" in blamed and BLAMED.code in blamed
    assert "called from scalify/parallel/megatron.py:140" in blamed
    for loc, shown in zip(NEARBY, texts["nearby"], strict=True):
        assert shown.startswith(str(loc)) and loc.code in shown
    assert texts["relation"] == [f"Found{found}Expected{expected}"]


def test_verified_page_shows_verdict_and_timings_and_no_discrepancy(chromium, tmp_path):
    texts = browse(chromium, Report("llama-tiny-tp2", True, "verified", timings=TIMINGS), tmp_path)

    assert texts["verdict"] == ["verified"]
    assert texts["timings"] == ["capture1.23verify4.50"]
    assert "discrepancy" not in texts
