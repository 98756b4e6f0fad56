"""The layers of docs/architecture.md MUST hold in the code: suites import only dsconform.suite,
every import of the library points down its layers and none closes a cycle, the library never
reaches up into the plugin, suites or tests, and no module grows past 600 lines."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsconform"
MAX_LINES = 600


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


def _capabilities(stem: str) -> set[str]:
    """The capability derived from a suite module's file name, and its CAPABILITY where it
    states one (the modules of a suite split by concern state the same)."""
    found = {stem.removeprefix("test_").removesuffix("_ranks").removesuffix("s")}
    path = ROOT / "suites" / f"{stem}.py"
    if path.exists():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "CAPABILITY" for t in node.targets) \
                    and isinstance(node.value, ast.Constant):
                found.add(str(node.value.value))
    return found


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
                    and not _capabilities(target) & _capabilities(path.stem):
                bad.append(f"{path.name} imports another suite's module {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_library_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _library_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_suite_file_is_over_600_lines():
    """A suite too long to read as a spec is split by concern (its modules share CAPABILITY)."""
    long = {p.name: n for p in (ROOT / "suites").glob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_library_never_imports_suites_fixtures_or_tests():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _library_files() for name in _imports(p)
           if name.split(".")[0] in ("suites", "fixtures", "tests")]
    assert not bad, "\n".join(bad)


#: The library's layers, bottom first. A module may import a module of its own subpackage or of
#: a LOWER layer, never one of its own layer's other subpackages or of a higher layer; so for
#: every pair of subpackages this states which may import the other (docs/architecture.md).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "settings", "units"),  # the foundations: DSCONFORM_* settings, units
    ("base",),                          # versions, pairwise, compat, removals, fds, cpu
    ("node", "results", "harness"),     # the node's facts; results files; the rank contract
    ("checks",),                        # tolerances, comparisons, DeepSpeed configs
    ("profile",),                       # what a node is held to
    ("gate",),                          # requires(), known issues
    ("ops",),                           # building, loading and checking DeepSpeed's ops
    ("storage",),                       # NVMe paths, DeepNVMe I/O and tuning
    ("plugin", "tools"),                # the pytest hooks; the commands beside a run
    ("suite", "cli"),                   # the suites' one facade; the command line
)
RANK = {area: n for n, layer in enumerate(LAYERS) for area in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def _library_graph() -> dict[str, set[tuple[str, int]]]:
    """Each library module -> every library module it imports, with the line: top-level
    imports and those inside functions, classes and ``if TYPE_CHECKING:`` blocks alike.
    ``from P import a`` names P.a where that is a module, else P; relative imports resolved."""
    files = {_module_name(p): p for p in _library_files()}
    graph: dict[str, set[tuple[str, int]]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # import a.b.c -> the module a.b.c is in
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add((target, node.lineno))
        graph[name] = edges
    return graph


def _module_area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_subpackage_has_a_layer():
    areas = {_area(p) for p in _library_files()}
    assert not areas - set(RANK), f"place {sorted(areas - set(RANK))} in LAYERS"


def test_imports_only_point_down():
    """Every import between subpackages, function-level ones included, goes to a lower layer."""
    bad = []
    for module, edges in _library_graph().items():
        area = _module_area(module)
        for target, line in edges:
            other = _module_area(target)
            if other != area and RANK[other] >= RANK[area]:
                where = "its own layer" if RANK[other] == RANK[area] else "a higher layer"
                bad.append(f"{module}:{line} imports {target} ({other}: {where})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    """No module reaches itself through imports, function-level ones included (within a
    subpackage too: two files that import each other are one concern split in two)."""
    graph = {m: sorted({t for t, _ in edges}) for m, edges in _library_graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in graph[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                component.append(t)
                if t == m:
                    break
            if len(component) > 1:
                cycles.append(" <-> ".join(sorted(component)))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, "\n".join(cycles)


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


def test_every_subpackage_ships_in_the_wheel():
    """pyproject.toml lists the packages a wheel carries: a subpackage missing there imports from
    a checkout and fails from a wheel install (the air-gapped bundle)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    packages = {_module_name(p) for p in _library_files() if p.name == "__init__.py"}
    assert not packages - listed, f"add {sorted(packages - listed)} to pyproject.toml's packages"
