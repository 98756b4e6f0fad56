"""The console of a run shows pytest's header, progress and summary only: what ranks print goes
to ranks.log (with rank and test id on each line) and into the report of the test that failed;
a run stopped by a collection error says so; and the process exits promptly after its summary,
rank pools alive or not.

One real pytest process (the console is what reaches its file descriptors) runs a small suite
whose rank functions print on every channel a rank has (Python's stdout and stderr, the fd
itself as native code writes, warnings.warn): run_ranks calls from tests, a passing and a
failing one, and a background cell batch of two cells (lanes forced on), one failing. Standby
ranks are forced on, so pools are alive and starting when the session ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FNS = '''
import os
import sys
import warnings

import torch.distributed as tdist


def chatty(tag, fail_rank=-1):
    r = tdist.get_rank()
    print(f"{tag} python-stdout rank{r}")
    sys.stderr.write(f"{tag} python-stderr rank{r}\\n")
    os.write(2, f"{tag} native-stderr rank{r}\\n".encode())
    warnings.warn(f"{tag} a-warning rank{r}")
    if r == fail_rank:
        raise ValueError(f"{tag} deliberate failure")
    return r
'''

SUITE = '''
import deepspeed  # noqa: F401 - the controller of a suite run imports it
import pytest
from dsconform.suite import RankCall, batched, cell_results, run_ranks

import console_fns

# What a suite run's controller holds (torch's, DeepSpeed's and hypothesis's objects, the
# collected items), which pytest's end and the interpreter's walk: a CPU tier run took 3-3.5 s
# from its summary to its exit on the 2-core CPU machine, this demo alone 3.6 s.
HELD = [[i] for i in range(3_000_000)]


def test_passing():
    assert run_ranks(console_fns.chatty, 2, timeout_s=120, args=("TAG-PASS",),
                     accelerator="cpu") == [0, 1]


def test_failing():
    run_ranks(console_fns.chatty, 2, timeout_s=120, args=("TAG-FAIL", 1), accelerator="cpu")


def plan(params, workdir, run):
    fail = 1 if params["kind"] == "bad" else -1
    return RankCall(console_fns.chatty, 2, 120, args=(f"TAG-CELL-{params['kind']}", fail),
                    accelerator="cpu")


@batched(plan)
@pytest.mark.parametrize("kind", ["ok", "bad"])
def test_cell(kind, request, scratch):
    assert cell_results(request, scratch) == [0, 1]
'''

#: Starts standby ranks as collection ends, outside pytest's capture, as a GPU run does (their
#: warm-up engine prints DeepSpeed's "[WARNING] ... untested optimizer"); and times the
#: session's own end from inside: pytest_unconfigure's start (before every other
#: implementation) to the last atexit handler (registered first, so run last).
TIMING = '''
import atexit
import os
import time

import pytest

_T = {}


def pytest_collection_finish(session):
    from dsconform.harness import api

    api.start_spares([2], "cpu")


def _done():
    with open(os.environ["CONSOLE_TIMING"], "w") as f:
        f.write(str(time.monotonic() - _T.get("unconfigure", time.monotonic())))


atexit.register(_done)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    _T["unconfigure"] = time.monotonic()
'''

NOISE = re.compile(r"\[WARNING\]|\[INFO\]|UserWarning|OVERFLOW|ds_accelerator|TAG-")


@pytest.fixture(scope="module")
def console_run(tmp_path_factory):
    """(console lines with their seconds since start, the exit's seconds, results dir, the
    session's own teardown seconds)."""
    d = tmp_path_factory.mktemp("console")
    (d / "console_fns.py").write_text(FNS)
    (d / "test_console_demo.py").write_text(SUITE)
    (d / "timing_plugin.py").write_text(TIMING)
    results = d / "results"
    timing = d / "teardown.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), str(ROOT)]),
           "DSCONFORM_LANES": "2", "DSCONFORM_SPARE_POOLS": "1",
           "CONSOLE_TIMING": str(timing)}
    cmd = [sys.executable, "-m", "pytest", "test_console_demo.py", "-p", "fixtures.plugin",
           "-p", "timing_plugin", "-p", "no:cacheprovider", "--rootdir", str(d),
           "--results", str(results)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    proc.wait(timeout=600)
    ended = time.monotonic() - t0
    return lines, ended, results, float(timing.read_text()), proc.returncode


def _before_failures(lines: list[tuple[float, str]]) -> list[str]:
    texts = [t for _, t in lines]
    end = next((i for i, t in enumerate(texts) if re.match(r"^=+ FAILURES =+$", t)), len(texts))
    return texts[:end]


def _report_of(lines: list[tuple[float, str]], test: str) -> str:
    """The failures section's part for one test (its header line to the next one)."""
    texts = [t for _, t in lines]
    start = next(i for i, t in enumerate(texts) if re.match(rf"^_+ {re.escape(test)} _+$", t))
    end = next((i for i in range(start + 1, len(texts))
                if re.match(r"^(_+ \S.* _+|=+ .* =+)$", texts[i])), len(texts))
    return "\n".join(texts[start:end])


def test_the_console_holds_no_rank_output(console_run):
    lines, _, _, _, rc = console_run
    assert rc == pytest.ExitCode.TESTS_FAILED, "\n".join(t for _, t in lines)
    noise = [t for t in _before_failures(lines) if NOISE.search(t)]
    assert not noise, "rank output on the console:\n" + "\n".join(noise)
    # Only failing tests show their ranks' part, in their report.
    assert not [t for _, t in lines if "TAG-PASS" in t or "TAG-CELL-ok" in t]


def test_ranks_log_has_every_line_with_rank_and_test(console_run):
    _, _, results, _, _ = console_run
    log = (results / "ranks.log").read_text().splitlines()
    for tag, test in (("TAG-PASS", "test_passing"), ("TAG-FAIL", "test_failing"),
                      ("TAG-CELL-ok", "test_cell[ok]"), ("TAG-CELL-bad", "test_cell[bad]")):
        for r in (0, 1):
            for channel in ("python-stdout", "python-stderr", "native-stderr", "a-warning"):
                want = (f"rank {r}/2 | test_console_demo.py::{test} | ",
                        f"{tag} {channel} rank{r}")
                assert any(ln.startswith(want[0]) and want[1] in ln for ln in log), \
                    (want, "\n".join(ln for ln in log if tag in ln))


def test_a_failing_tests_report_shows_its_own_rank_output(console_run):
    lines, _, _, _, _ = console_run
    for test, mine, others in (("test_failing", "TAG-FAIL", ("TAG-PASS", "TAG-CELL")),
                               ("test_cell[bad]", "TAG-CELL-bad", ("TAG-PASS", "TAG-FAIL",
                                                                   "TAG-CELL-ok"))):
        report = _report_of(lines, test)
        assert "Captured rank stdout/stderr call" in report, report
        for r in (0, 1):
            assert f"rank {r}/2: {mine} native-stderr rank{r}" in report, report
            assert f"rank {r}/2: {mine} python-stdout rank{r}" in report, report
        assert not [o for o in others if o in report], report


def test_the_process_exits_promptly_after_its_summary(console_run):
    """pytest ends within 2 s of its summary: pools (used, standby, lanes) are stopped
    together, and the end's garbage collections skip what the controller holds. Inside, from
    pytest_unconfigure to the last atexit handler: < 1 s (0.03-0.1 s here; 2.1-2.2 s when every
    object was walked); from the summary line to the process's exit: < 2 s (0.3-0.45 s here;
    3.6-3.7 s before)."""
    lines, ended, _, teardown_s, _ = console_run
    summary_at = max(t for t, text in lines if re.match(r"^=+ .* in [0-9.]+s .*=+$", text))
    assert teardown_s < 1.0, f"the session's own end took {teardown_s:.2f} s"
    assert ended - summary_at < 2.0, f"exited {ended - summary_at:.2f} s after its summary"


def test_a_collection_error_is_named_as_the_reason_the_run_stopped(pytester):
    """A suite file that does not import stops the run at collection: the summary (txt, json,
    the console) names the file and the error's first line, not an interruption."""
    pytester.makepyfile(test_fine="def test_a():\n    pass\n",
                        test_broken="raise ImportError('no torch here')\n")
    results = pytester.path / "results"
    result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(results),
                                "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    said = ("the run stopped at collection after 0 tests: 1 file did not collect: "
            "test_broken.py: ImportError: no torch here")
    summary = json.loads((results / "summary.json").read_text())
    assert any(n.startswith(said) for n in summary["notices"]), summary["notices"]
    assert summary["collection_errors"] == [{"nodeid": "test_broken.py",
                                             "error": "ImportError: no torch here"}]
    assert f"NOTE: {said}" in (results / "summary.txt").read_text()
    assert "interrupted" not in (results / "summary.txt").read_text()
    result.stdout.fnmatch_lines([f"dsconform: {said}*"])


LEAKY_FNS = '''
import multiprocessing
import os
import signal


def leave_a_semaphore():
    # Registered with the run's resource tracker, which every rank shares; a killed rank never
    # unregisters it, and the tracker names it when the run's last process has ended.
    sem = multiprocessing.get_context("spawn").Semaphore()
    os.kill(os.getpid(), signal.SIGKILL)
    return sem
'''

LEAKY_SUITE = '''
import pytest
from dsconform.suite import RankError, run_ranks

import leaky_fns


def test_a_rank_dies_holding_a_semaphore():
    with pytest.raises(RankError):
        run_ranks(leaky_fns.leave_a_semaphore, 1, timeout_s=120, accelerator="cpu")
'''


def test_what_the_resource_tracker_says_at_the_end_goes_to_the_rank_log(tmp_path):
    """multiprocessing's resource tracker, which every rank shares, names the semaphores killed
    ranks left when the run's last process has ended, after pytest's summary: that goes to
    ranks.log, not to the console."""
    (tmp_path / "leaky_fns.py").write_text(LEAKY_FNS)
    (tmp_path / "test_leaky_demo.py").write_text(LEAKY_SUITE)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_leaky_demo.py", "-p", "fixtures.plugin",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "--results", str(results)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    assert "leaked semaphore" not in console, console
    # The tracker writes once the pytest process and its ranks are gone: wait for it.
    deadline = time.monotonic() + 30
    log = results / "ranks.log"
    while "leaked semaphore" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "leaked semaphore" in log.read_text(), log.read_text()[-2000:]
