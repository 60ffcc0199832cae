"""Unified diffs against an installed package apply to its source while inside
`source_patches`, and its original modules come back after."""
import importlib
import sys

import pytest

from scalify.capture.source_patches import source_patches
from scalify.errors import ConfigError

ORIGINAL = "def scale(x):\n    return 2 * x\n\n\nFACTOR = 2\n"
DIFF = """A fault planted in toypkg.ops.

--- a/toypkg/ops.py
+++ b/toypkg/ops.py
@@ -1,5 +1,5 @@
 def scale(x):
-    return 2 * x
+    return 3 * x
 
 
 FACTOR = 2
"""


@pytest.fixture
def toypkg(tmp_path, monkeypatch):
    """An installed package `toypkg` (a folder on sys.path) whose `ops` is imported."""
    package = tmp_path / "site" / "toypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .ops import scale\n")
    (package / "ops.py").write_text(ORIGINAL)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    import toypkg
    yield tmp_path
    for name in [n for n in sys.modules if n.split(".")[0] == "toypkg"]:
        del sys.modules[name]


def test_a_patched_module_is_imported_from_its_copy_and_restored_after(toypkg):
    diff = toypkg / "fault.diff"
    diff.write_text(DIFF)
    with source_patches([diff]) as patched:
        import toypkg
        assert toypkg.scale(1) == 3  # the package's own import of ops sees the patch
        [module] = patched
        assert module.name == "toypkg.ops" and module.changed_lines == (2,)
        assert module.copy.read_text().splitlines()[1] == "    return 3 * x"
        assert sys.modules["toypkg.ops"].__file__ == str(module.copy)
    import toypkg
    assert toypkg.scale(1) == 2


@pytest.mark.parametrize(("old", "new", "refusal"), [
    (" FACTOR = 2", " FACTOR = 5", "fault.diff: does not apply to"),
    ("toypkg", "no_such_package_here", "no package 'no_such_package_here' is installed"),
], ids=["stale context", "no such package"])
def test_a_diff_that_cannot_apply_is_refused_naming_it(toypkg, old, new, refusal):
    diff = toypkg / "fault.diff"
    diff.write_text(DIFF.replace(old, new))
    with pytest.raises(ConfigError, match=refusal):
        with source_patches([diff]):
            pass
