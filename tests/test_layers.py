"""vmplane's import graph has no circle: imports under TYPE_CHECKING and inside functions count too.

The layers' direction itself is import-linter's contract (pyproject.toml, `lint-imports`); this test
runs scripts/import_cycles.py in-process, so the fast tier fails on a circle even where lint is not run.
"""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_cycles.py"


def _import_cycles():
    """scripts/ is no package: load the checker from its file."""
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_circle():
    circles = _import_cycles().cycles()
    shown = "\n".join(f"{' -> '.join(c.path)}\n  " + "\n  ".join(c.lines) for c in circles)
    assert not circles, f"{len(circles)} import circle(s):\n{shown}"


def test_the_checker_finds_every_circle_and_only_circles():
    """Tarjan's components on a small graph: two circles (one through three modules), a module that
    imports itself, and a chain that is no circle."""
    check = _import_cycles()
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"f"}, "g": {"a"}, "h": set()}
    components = sorted(check.strongly_connected(edges))
    assert components == [["a", "b", "c"], ["d", "e"], ["f"], ["g"], ["h"]]
    assert check.closed_path(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert check.closed_path(["d", "e"], edges) == ["d", "e", "d"]


def test_the_report_names_the_largest_modules_and_classes():
    report = _import_cycles().report(top=3)
    modules, classes = report.split("largest classes")
    assert len(modules.splitlines()) == 1 + 3 and len(classes.splitlines()) == 1 + 3
    assert "vmplane." in classes
