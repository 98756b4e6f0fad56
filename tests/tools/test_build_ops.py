"""`dsconform build-ops`: builds into the cache a run loads from, says per op how it went, exits
0 / 1 / 2; and its default covers every op the suites load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsconform.ops.prebuild import RUN_OPS

ROOT = Path(__file__).resolve().parents[2]

#: Of RUN_OPS, those the acceptance tier loads only where the profile promises them: gds
#: (NVME-GDS-1 is marked promised_ops_only, NVME-GDS-2 runs on paths with gds = true).
PROMISED_ONLY = ("gds",)

def _build_ops(*args: str, env: dict | None = None,
               drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run([sys.executable, "-m", "dsconform.cli", "build-ops", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**environ, **(env or {})})


@pytest.mark.parametrize(("args", "says"), [
    (["--jobs", "0"], "--jobs 0: must be at least 1"),
    (["no_such_op"], "no_such_op: not an op of DeepSpeed's cpu accelerator"),
    (["--profile", "no-such-profile"], "no-such-profile"),
    (["--profile", "h200-x2"], "export DS_ACCELERATOR=cuda"),
])
def test_bad_input_exits_2_saying_what_to_fix(args, says):
    out = _build_ops(*args)
    assert out.returncode == 2, out
    assert says in out.stderr, out.stderr


def test_ops_in_the_cache_load_and_exit_0():
    """cpu_adam, once in this environment's cache (a first call builds it where no earlier run
    has): it says "cached" and loads it, exit 0."""
    first = _build_ops("cpu_adam")
    assert first.returncode == 0, first.stdout + first.stderr
    out = _build_ops("cpu_adam")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("dsconform build-ops: 1 ops (cpu_adam) for DeepSpeed's cpu "
                               "accelerator into "), lines
    # Already built: said so, not "building".
    assert "dsconform build-ops: cpu_adam: cached, loading it" in lines, lines
    assert "building" not in out.stdout, out.stdout
    assert lines[-2].startswith("dsconform build-ops: cpu_adam: cached, loaded in "), lines
    assert lines[-1].startswith("dsconform build-ops: all 1 built"), lines


def test_a_kept_bytecode_cache_gets_a_rank_warm_up(tmp_path):
    """Where PYTHONDONTWRITEBYTECODE is set, build-ops also starts one rank the way a run does
    (a first engine included) beside the builds, so the bytecode cache holds what a run's ranks
    import; the extensions cache is this environment's, so cpu_adam only loads."""
    from dsconform.ops.cache import ensure_extensions_dir

    cache = tmp_path / "cache"
    out = _build_ops("cpu_adam", env={"PYTHONDONTWRITEBYTECODE": "1",
                                      "DSCONFORM_CACHE": str(cache),
                                      "TORCH_EXTENSIONS_DIR": str(ensure_extensions_dir())},
                     drop=("PYTHONPYCACHEPREFIX",))  # this session's own, if it keeps one
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-3].startswith("dsconform build-ops: rank warm-up: "), lines
    assert lines[-3].endswith(" s (its imports are in the bytecode cache)"), lines
    # What a run's pytest process imports is compiled too: pytest, hypothesis, this package.
    assert lines[-2].startswith("dsconform build-ops: run packages compiled: "), lines
    assert "did not compile" not in lines[-2], lines
    assert "rank 0/1 |" not in out.stdout + out.stderr  # DeepSpeed's start-up lines stay out
    kept = list((cache / "pycache").rglob("*.pyc"))
    assert any(p.name.startswith("engine.") and "runtime" in p.parts for p in kept), len(kept)
    for package, module in (("hypothesis", "strategies."), ("_pytest", "python."),
                            ("dsconform", "suite.")):
        assert any(p.name.startswith(module) and package in p.parts for p in kept), package


def test_a_failing_build_exits_1_with_its_diagnosis(tmp_path):
    """A compiler that fails: cpu_adam cannot build into an empty cache; the diagnosis says so."""
    out = _build_ops("cpu_adam", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
                                      "CXX": "/bin/false", "CC": "/bin/false"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "dsconform build-ops: cpu_adam: FAILED after " in out.stdout, out.stdout
    assert "op cpu_adam" in out.stdout
    assert out.stdout.splitlines()[-1] == "dsconform build-ops: 1 of 1 failed: cpu_adam"


#: Records each collected test's accelerator and the ops it loads (requires(op=...)).
_COLLECTOR = '''
import json, os
from dsconform.gate.requires import item_ops


def pytest_collection_finish(session):
    rows = []
    for it in session.items:
        callspec = getattr(it, "callspec", None)
        cuda = it.get_closest_marker("gpu") is not None or (
            callspec is not None and callspec.id.startswith("cuda"))
        rows.append([it.nodeid, "cuda" if cuda else "cpu", item_ops(it),
                     it.get_closest_marker("promised_ops_only") is not None])
    with open(os.environ["OPS_OUT"], "w") as f:
        json.dump(rows, f)
'''


def test_the_default_covers_every_op_the_suites_load(tmp_path):
    """RUN_OPS (what build-ops builds beside the profile's promises) holds every op a suite's
    test says it loads, on its accelerator: after build-ops, a run builds nothing."""
    (tmp_path / "ops_collector.py").write_text(_COLLECTOR)
    out_file = tmp_path / "ops.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites", "--collect-only", "-q", "-m", "",
         "-p", "ops_collector", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OPS_OUT": str(out_file),
             "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert out_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out_file.read_text())
    assert len(rows) > 1000 and any(ops for _, _, ops, _ in rows)
    missing = sorted({f"{accel}: {op} ({nodeid})" for nodeid, accel, ops, _ in rows
                      for op in ops if op not in RUN_OPS[accel]})
    assert not missing, "\n".join(missing)
    # PROMISED_ONLY (left out of an acceptance run's early builds unless promised) holds the
    # ops that only promised_ops_only tests load in the acceptance tier, or tests of an NVMe
    # path's GDS promise.
    promised_only = {op for _, _, ops, marked in rows if marked for op in ops}
    assert promised_only == set(PROMISED_ONLY)
    elsewhere = {nodeid for nodeid, _, ops, marked in rows
                 if not marked and set(ops) & promised_only and "gds_file_io" not in nodeid}
    assert not elsewhere, sorted(elsewhere)
