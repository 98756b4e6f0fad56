"""The layers of docs/architecture.md MUST hold in the code: suites import only dsconform.suite,
the library never reaches up into the plugin, suites or tests, and no module grows past 600
lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsconform"
MAX_LINES = 600
FOUNDATIONS = {"settings", "units", "__init__"}


def _imports(path: Path) -> set[str]:
    """Every module path the file imports (from X import a -> X and X.a)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _area(path: Path) -> str:
    """The subpackage (or top-level module) a library file belongs to."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _library_areas(imported: set[str]) -> set[str]:
    areas = set()
    for name in imported:
        parts = name.split(".")
        if parts[0] == "dsconform" and len(parts) > 1:
            areas.add(parts[1])
    return areas


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "hardware_profiles" not in p.parts)


def _capability(stem: str) -> str:
    return stem.removeprefix("test_").removesuffix("_ranks").removesuffix("s")


def test_suites_import_only_the_suite_module_and_no_other_suite():
    """A suite and its rank module (code run inside ranks lives beside its suite) may import
    each other; nothing else of suites/, and of dsconform only dsconform.suite."""
    suites = sorted((ROOT / "suites").glob("*.py"))
    names = {p.stem for p in suites}
    bad = []
    for path in suites:
        for name in _imports(path):
            if name.startswith("dsconform") and not name.startswith("dsconform.suite") \
                    and name != "dsconform":
                bad.append(f"{path.name} imports {name}")
            parts = name.split(".")
            target = parts[1] if parts[0] == "suites" and len(parts) > 1 else \
                (parts[0] if parts[0] in names else None)
            if target and target in names and target != path.stem \
                    and _capability(target) != _capability(path.stem):
                bad.append(f"{path.name} imports another suite's module {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_library_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _library_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_library_never_imports_suites_fixtures_or_tests():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _library_files() for name in _imports(p)
           if name.split(".")[0] in ("suites", "fixtures", "tests")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("area", "allowed"), [
    ("node", set()),
    ("results", set()),
    ("settings", set()),
    ("units", set()),
    ("tools", set()),
    ("harness", {"ops"}),
])
def test_lower_layers_import_only_what_they_may(area, allowed):
    bad = []
    for path in _library_files():
        if _area(path) != area:
            continue
        used = _library_areas(_imports(path)) - FOUNDATIONS - {area}
        if area == "harness":
            # its ranks build DeepSpeed ops, so it clears their stale build locks: that only
            ops_used = {n for n in _imports(path) if n.startswith("dsconform.ops")}
            if ops_used - {"dsconform.ops", "dsconform.base.buildlock",
                           "dsconform.base.buildlock.StaleBuildLock",
                           "dsconform.base.buildlock.clear_stale"}:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(ops_used)}")
        if used - allowed:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(used - allowed)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("area", "importers"), [
    ("plugin", {"plugin", "suite"}),
    ("tools", {"cli", "tools"}),
    ("cli", {"cli"}),
])
def test_upper_layers_are_imported_only_from_above(area, importers):
    bad = [f"{p.relative_to(ROOT)} imports dsconform.{area}" for p in _library_files()
           if area in _library_areas(_imports(p)) and _area(p) not in importers]
    assert not bad, "\n".join(bad)


def test_the_entry_point_imports_neither_torch_nor_deepspeed():
    """The pytest11 entry point is loaded by every pytest run of the environment: it must stay
    cheap and inert."""
    code = ("import sys, dsconform.plugin.options\n"
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
