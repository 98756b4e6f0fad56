"""While a caller waits for an op's build, it hears every PROGRESS_S which op and how long it has
been building: a run's test waiting in its setup or body (a line on the terminal between
pytest's progress), and `dsconform build-ops`.

Builds are stand-ins (a process that sleeps, then reports as a build does) with a short
PROGRESS_S, scheduled by the real ParallelBuilds.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from dsconform.ops import prebuild as opbuild
from dsconform.ops.prebuild import ParallelBuilds, Progress
from dsconform.tools import build_ops

SLEEPER = f"""
import json, sys, time
time.sleep(float(sys.argv[2]))
print({opbuild._MARK!r} + json.dumps({{"op": sys.argv[1], "loaded": True, "built_now": True,
                                       "failure": None, "build_seconds": 0.1}}), flush=True)
"""

#: Seconds each stand-in build takes.
SECONDS = {"slow": 1.6, "quick": 0.1}


def _sleeper(op: str, nice: int) -> list[str]:
    return [sys.executable, "-c", SLEEPER, op, str(SECONDS.get(op, 1.6))]


@pytest.fixture
def fast_progress(monkeypatch):
    monkeypatch.setattr(opbuild, "PROGRESS_S", 0.4)


def test_a_wait_hears_the_op_and_its_seconds_every_interval(fast_progress, monkeypatch):
    monkeypatch.setitem(SECONDS, "next", 2.4)
    heard: list[Progress] = []
    builds = ParallelBuilds.start(["slow", "next"], 2, command=_sleeper,
                                  on_progress=heard.append, share_cpu_info=False)
    try:
        t0 = time.monotonic()
        assert builds.wait("next", timeout_s=60)["loaded"]
        took = time.monotonic() - t0
    finally:
        builds.close()
    # Both build at once; "slow" ends first, and the lines after it name "next" alone.
    assert len(heard) >= int(took / 0.4) - 1 >= 4, (took, heard)
    first = heard[0]
    assert first.op == "next" and [op for op, _ in first.building] == ["slow", "next"]
    assert re.fullmatch(r"op next: building, 0 s so far; beside it slow 0 s", first.line())
    assert re.fullmatch(r"op next: building, \d+ s so far", heard[-1].line())
    secs = [dict(p.building)["next"] for p in heard]
    assert secs == sorted(secs) and secs[-1] >= 1.6


def test_wait_all_says_it_every_interval_not_once_per_op(fast_progress, monkeypatch):
    """Three builds, the later ones longer: wait_all's waits together take longer than the
    interval, and say so once per interval, not once per op."""
    monkeypatch.setattr(opbuild, "PROGRESS_S", 0.6)
    for op, secs in (("a", 0.5), ("b", 1.0), ("c", 1.5)):
        monkeypatch.setitem(SECONDS, op, secs)
    heard: list[Progress] = []
    builds = ParallelBuilds.start(["a", "b", "c"], 2, command=_sleeper,
                                  on_progress=heard.append, share_cpu_info=False)
    try:
        t0 = time.monotonic()
        assert all(r["loaded"] for r in builds.wait_all(timeout_s=60).values())
        took = time.monotonic() - t0
    finally:
        builds.close()
    assert took > 1.2 and 1 <= len(heard) <= took / 0.6, (took, heard)


def test_no_listener_no_lines_and_the_timeout_still_holds(fast_progress):
    builds = ParallelBuilds.start(["slow"], 1, command=_sleeper, share_cpu_info=False)
    try:
        r = builds.wait("slow", timeout_s=0.3)
    finally:
        builds.close()
    assert not r["loaded"] and "did not finish within 0 s" in r["failure"]


def test_progress_lines():
    assert Progress("a", 20, [("a", 31.4)]).line() == "op a: building, 31 s so far"
    assert (Progress("b", 16.0, [("a", 45.0)]).line()
            == "op b: waiting 16 s for its build; beside it a 45 s")
    assert (Progress("a", 15.2, [("a", 15.0), ("b", 3.0)]).line()
            == "op a: building, 15 s so far; beside it b 3 s")


def test_build_ops_prints_the_running_builds(capsys):
    progress = build_ops._Progress()
    progress.tick(Progress("a", 15.0, [("a", 15.2), ("b", 4.0)]))
    progress.tick(Progress("a", 30.0, []))  # nothing running: nothing to say
    assert capsys.readouterr().out.splitlines() == [
        "dsconform build-ops: a: building, 15 s so far; b: building, 4 s so far"]


def test_build_ops_says_how_each_op_ended(capsys):
    """A cached op loads; a build that found its op built by another one (DeepSpeed's CPU
    accelerator builds shm_comm as it starts) says so rather than "cached"."""
    progress = build_ops._Progress()
    progress("cpu_adam", "start", {"cached": True})
    progress("cpu_adam", "done", {"loaded": True, "built_now": False, "cached": True,
                                  "wall_seconds": 2.0})
    progress("shm_comm", "start", {"cached": False, "jobs": 2, "beside": []})
    progress("shm_comm", "done", {"loaded": True, "built_now": False, "cached": False,
                                  "wall_seconds": 9.0})
    progress("fused_adam", "start", {"cached": False, "jobs": 2, "beside": ["shm_comm"],
                                     "nice": 10})
    progress("fused_adam", "done", {"loaded": True, "built_now": True, "cached": False,
                                    "wall_seconds": 40.0})
    assert [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()] == [
        "cpu_adam: cached, loading it", "cpu_adam: cached, loaded in 2.0 s",
        "shm_comm: building (MAX_JOBS=2)", "shm_comm: found built by then, loaded in 9.0 s",
        "fused_adam: building (MAX_JOBS=2, nice 10, beside shm_comm)",
        "fused_adam: built in 40.0 s"]


WAITER = '''
def test_waits_for_its_op(run):
    """WAIT-1: waits for a build."""
    assert run.op_builds.wait("slow", timeout_s=60)["loaded"]
'''

#: Starts the stand-in build where a run's plugin starts the real ones (before its own
#: collection's end adopts them), so the wait is the run's.
STARTER = f'''
import sys

import pytest

from dsconform.ops.prebuild import ParallelBuilds
from dsconform.plugin.runstate import run_state

SLEEPER = {SLEEPER!r}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    run_state(session.config).op_builds = ParallelBuilds.start(
        ["slow"], 1, share_cpu_info=False,
        command=lambda op, nice: [sys.executable, "-c", SLEEPER, op, "1.6"])
'''


def test_a_test_waiting_for_a_build_shows_a_line_on_the_terminal(fast_progress, pytester,
                                                                   tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    pytester.makeconftest(STARTER)
    pytester.makepyfile(test_wait=WAITER)
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(profile),
                                "--results", str(pytester.path / "res"))
    result.assert_outcomes(passed=1)
    lines = [ln for ln in result.outlines if ln.startswith("dsconform: op slow")]
    assert len(lines) >= 2, "\n".join(result.outlines)
    assert all(re.fullmatch(r"dsconform: op slow: building, \d+ s so far", ln) for ln in lines)
    # Between pytest's progress: after the file's name, and the test's dot after them.
    at = result.outlines.index(lines[0])
    assert result.outlines[at - 1].startswith("test_wait.py"), result.outlines[at - 1]
    after = [ln for ln in result.outlines[at + len(lines):] if ln.strip()]
    assert re.match(r"^test_wait.py \. +\[100%\]$", after[0]), result.outlines
    doc = json.loads((pytester.path / "res" / "summary.json").read_text())
    assert doc["capabilities"] == {"project": {"passed": 1}}
