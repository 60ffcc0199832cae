"""Unified diffs against installed packages, applied to their source while programs are captured.

A user checks a fix (or plants a fault) in a framework's code without touching its install: each
file a diff names (`a/megatron/core/models/gpt/gpt_model.py`, a path below the directory the
package is installed in) is patched into a copy (whatthepatch applies the hunks, refusing one
whose context does not match; the copies are kept, named by the diff's text), and while the patches are in force those modules are imported
from the copies: the package's modules are dropped from `sys.modules` and imported again through
a finder that serves the copies. Reports then name lines of the patched copies. On leaving, the
package's original modules come back.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import whatthepatch

from ..errors import ConfigError


@dataclass(frozen=True)
class PatchedModule:
    """A module imported from a patched copy of its source."""

    name: str
    original: Path
    copy: Path
    changed_lines: tuple[int, ...]  # lines of the copy the diff added


class _CopyFinder(importlib.abc.MetaPathFinder):
    """Finds the patched modules at their copies (every other module as usual)."""

    def __init__(self, modules: dict[str, PatchedModule]) -> None:
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        module = self.modules.get(fullname)
        if module is None:
            return None
        package = module.original.name == "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, module.copy,
            submodule_search_locations=[str(module.original.parent)] if package else None)


def patched_modules(diff: Path, into: Path) -> list[PatchedModule]:
    """The modules `diff` patches, their patched copies written under `into`."""
    try:
        parsed = list(whatthepatch.parse_patch(diff.read_text()))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{diff}: cannot read the patch ({error})") from error
    if not parsed:
        raise ConfigError(f"{diff}: no unified diff in the file")
    modules = []
    for change in parsed:
        relative = _relative(change.header.new_path or change.header.old_path)
        original = _installed(relative, diff)
        try:
            lines = whatthepatch.apply_diff(change, original.read_text().splitlines())
        except whatthepatch.exceptions.HunkApplyException as error:
            raise ConfigError(f"{diff}: does not apply to {original}: {error}") from error
        copy = into / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text("\n".join(lines) + "\n")
        added = tuple(c.new for c in change.changes if c.old is None and c.new is not None)
        modules.append(PatchedModule(_module_name(relative), original, copy, added))
    return modules


@contextmanager
def source_patches(diffs: list[Path]) -> Iterator[list[PatchedModule]]:
    """While inside, the modules the diffs patch are imported from patched copies."""
    if not diffs:
        yield []
        return
    modules = [m for diff in diffs for m in patched_modules(diff, _copies_folder(diff))]
    packages = {m.name.split(".")[0] for m in modules}
    saved = _drop(packages)
    finder = _CopyFinder({m.name: m for m in modules})
    sys.meta_path.insert(0, finder)
    try:
        yield modules
    finally:
        sys.meta_path.remove(finder)
        _drop(packages)
        sys.modules.update(saved)


def _copies_folder(diff: Path) -> Path:
    """Where a diff's patched copies live: named by its text, kept after the run (reports
    show their lines)."""
    digest = hashlib.sha256(diff.read_bytes()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "scalify-patched" / digest


def _drop(packages: set[str]) -> dict:
    """Remove the packages' modules from `sys.modules`, returning them."""
    names = [n for n in sys.modules if n.split(".")[0] in packages]
    return {name: sys.modules.pop(name) for name in names}


def _relative(path: str) -> Path:
    """A diff's file path without its `a/` or `b/` prefix."""
    parts = Path(path).parts
    return Path(*parts[1:]) if parts and parts[0] in ("a", "b") and len(parts) > 1 else Path(path)


def _installed(relative: Path, diff: Path) -> Path:
    """Where the file `relative` (below the directory its top package is installed in) is."""
    spec = importlib.util.find_spec(relative.parts[0])
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{diff}: patches {relative}, but no package {relative.parts[0]!r} "
                          "is installed")
    for location in spec.submodule_search_locations:
        candidate = Path(location).parent / relative
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{diff}: patches {relative}, which the installed "
                      f"{relative.parts[0]!r} does not have")


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
