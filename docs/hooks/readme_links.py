"""MkDocs hook: fail the build when a relative link in README.md points at no file.

The README lies outside the site, so MkDocs' own link validation never sees it; its links to
docs/*.md are checked here instead, so moving or renaming a page cannot strand them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

LINK = re.compile(r"\]\(([^)\s]+)\)")


def on_pre_build(config: Any) -> None:
    """Check every relative link target of the README next to mkdocs.yml."""
    root = Path(config.config_file_path).resolve().parent
    broken = [target for target in relative_links((root / "README.md").read_text())
              if not (root / target.split("#")[0]).is_file()]
    if broken:
        raise PluginError(f"README.md links to missing files: {', '.join(broken)}")


def relative_links(markdown: str) -> list[str]:
    """Link targets that are neither URLs nor anchors on the same page."""
    return [target for target in LINK.findall(markdown)
            if not target.startswith(("#", "http://", "https://", "mailto:"))]
