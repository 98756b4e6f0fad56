"""A DeepSpeed default that moves MUST be named by `dsconform compare`, end to end.

The real ZeRO defaults test (suites/test_zero.py::test_effective_defaults, ZERO-DEF-1) runs
twice on the CPU accelerator, each time in its own pytest process with its own --results: as
is (DeepSpeed 0.19.8: gradient_clipping defaults to 1.0), and with DeepSpeed's default moved
back to 0.0 inside the rank (tests/compare_defaults_perturbed.py: what 0.19.0 did). Comparing
the two results files must name exactly the moved keys under "What silently changed", and the
defaults test itself must fail on the perturbed side (passed -> failed: a regression)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsconform.cli import main
from dsconform.results import compare
from dsconform.results import format as results_format

ROOT = Path(__file__).resolve().parents[2]
TEST = "suites/test_zero.py::test_effective_defaults"
MOVED = {"ZERO-DEF-1::default.gradient_clipping", "ZERO-DEF-1::default.constants."
         "GRADIENT_CLIPPING_DEFAULT"}


def _start(results: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", TEST, "-p", "no:cacheprovider", "-q", "--profile",
         "cpu-ci", "--results", str(results), *extra], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_moved_default_is_named_by_compare(tmp_path, capsys):
    real, old = tmp_path / "real", tmp_path / "old"
    # Both at once: each pays for spawning a rank and importing DeepSpeed.
    procs = [_start(real), _start(old, "-p", "tests.compare_defaults_perturbed")]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert procs[0].returncode == 0, outs[0][-3000:]
    assert procs[1].returncode == 1, outs[1][-3000:]
    assert "gradient_clipping: expected 1.0, found 0.0" in outs[1]

    result = compare.compare(results_format.load_benchmarks(real),
                             results_format.load_benchmarks(old))
    moved = {c.name: (c.base, c.new) for c in result.of(compare.CHANGED, compare.FACT)}
    assert moved == dict.fromkeys(MOVED, ("1.0", "0.0"))
    # Everything else the test reads was recorded on both sides and did not move.
    assert len(result.of(compare.UNCHANGED, compare.FACT)) >= 20
    [lost] = result.of(compare.REGRESSION, compare.OUTCOME)
    assert lost.name == "ZERO-DEF-1" and lost.detail.startswith("passed -> failed: ")

    # The command line says it the other way round too: 0.0 -> 1.0, the test fixed, exit 0.
    assert main(["compare", str(old), str(real), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "| ZERO-DEF-1::default.gradient_clipping | 0.0 | 1.0 |" in md
    assert "| ZERO-DEF-1 | failed | passed | fixed |" in md
