"""The console of a run: the node's verdict is the last line the plugin prints and the last line
of summary.txt, and says what dsconform.prom says; a failure shows the check's own frames and
message, the harness's frames only with -v; a rank's traceback starts at the rank function.

Small pytest sessions (pytester, in-process) against the real plugin.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from dsconform.harness import rank
from dsconform.plugin.console import RANK_LINES_SHOWN, rank_lines

ZERO = '''
CAPABILITY = "zero"

def test_a():
    """ZERO-A: passes."""

def test_b():
    """ZERO-B: fails."""
    assert 1 == 2, "zero says no"
'''

CKPT = '''
CAPABILITY = "checkpoint"

def test_c():
    """CKPT-C: fails."""
    assert 0, "checkpoint says no"

def test_d():
    """CKPT-D: fails."""
    assert 0, "checkpoint says no again"
'''

PASSING = '''
CAPABILITY = "zero"

def test_a():
    """ZERO-A: passes."""
'''

HARNESS = '''
from dsconform.suite import run_ranks

def test_bad_call():
    """HARNESS-1: the harness refuses a bad argument."""
    run_ranks(print, 2, timeout_s=0)
'''


@pytest.fixture
def run(pytester, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')

    def go(*args: str):
        return pytester.runpytest("-p", "fixtures.plugin", "--profile", str(profile),
                                  "--results", str(pytester.path / "res"), *args)
    return go


def _verdict_lines(result) -> list[str]:
    return [ln for ln in result.outlines if ln.startswith("dsconform: NODE ")]


def _last_before_pytests_counts(result) -> str:
    """The line before pytest's own last line (``== 3 failed, 1 passed in 0.1s ==``)."""
    lines = [ln for ln in result.outlines if ln.strip()]
    assert re.match(r"^=+ .* in [0-9.]+s", lines[-1]), lines[-1]
    return lines[-2]


def _prom_passed(pytester) -> float:
    prom = (pytester.path / "res" / "dsconform.prom").read_text()
    return float(re.search(r"^dsconform_node_passed (\S+)$", prom, re.M).group(1))


def test_a_failing_node_says_so_last_with_its_failures_and_capabilities(run, pytester):
    pytester.makepyfile(test_zero=ZERO, test_checkpoint=CKPT)
    result = run()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    want = f"dsconform: NODE {socket.gethostname()} FAILED (3 failures in 2 capabilities)"
    assert _verdict_lines(result) == [want]
    # After pytest's short test summary, which lists the failures.
    assert _last_before_pytests_counts(result) == want
    summary = (pytester.path / "res" / "summary.txt").read_text().splitlines()
    assert summary[-1] == want
    assert _prom_passed(pytester) == 0


def test_a_passing_node_says_passed(run, pytester):
    pytester.makepyfile(test_zero=PASSING)
    result = run()
    assert result.ret == pytest.ExitCode.OK
    want = f"dsconform: NODE {socket.gethostname()} PASSED"
    assert _last_before_pytests_counts(result) == want
    assert (pytester.path / "res" / "summary.txt").read_text().splitlines()[-1] == want
    assert _prom_passed(pytester) == 1


def test_a_run_that_ran_nothing_is_no_pass(run, pytester):
    pytester.makepyfile(test_zero=PASSING)
    result = run("-k", "no_such_test")
    assert _verdict_lines(result) == [f"dsconform: NODE {socket.gethostname()} FAILED "
                                      "(pytest exit status 5 (no tests ran))"]
    assert _prom_passed(pytester) == 0


def test_a_failure_shows_the_checks_frames_and_message_not_the_harness(run, pytester):
    pytester.makepyfile(test_harness=HARNESS)
    result = run()
    lines = result.outlines
    start = next(i for i, ln in enumerate(lines) if re.match(r"^_+ test_bad_call _+$", ln))
    end = next(i for i in range(start + 1, len(lines)) if re.match(r"^[-=]+ ", lines[i]))
    report = lines[start + 1:end]
    assert report == ["test_harness.py:5: in test_bad_call",
                      "    run_ranks(print, 2, timeout_s=0)",
                      "E   ValueError: timeout_s must be a positive number of seconds, got 0"], \
        "\n".join(lines)


def test_with_v_the_harness_frames_are_back(run, pytester):
    pytester.makepyfile(test_harness=HARNESS)
    text = "\n".join(run("-v").outlines)
    assert "dsconform/harness/errors.py" in text and "def check_timeout" in text


def test_a_rank_traceback_starts_at_the_rank_function():
    def fails():
        raise ValueError("the check's own words")

    kind, exc_type, message, text = rank.call_outcome(fails, (), {})
    assert (kind, exc_type, message) == ("error", "ValueError", "the check's own words")
    assert "in fails" in text and "call_outcome" not in text, text


def test_a_short_report_keeps_the_last_rank_lines():
    text = "".join(f"rank {i % 2}/2: line {i}\n" for i in range(100))
    short = rank_lines(text, short=True).splitlines()
    assert len(short) == RANK_LINES_SHOWN + 1
    assert short[0] == f"(the last {RANK_LINES_SHOWN} of 100 lines; all of them: ranks.log in " \
                       "--results, or -v)"
    assert short[-1] == "rank 1/2: line 99"
    assert rank_lines(text, short=False) == text
    few = "rank 0/1: one\n"
    assert rank_lines(few, short=True) == few


def test_a_message_only_failure_is_left_as_it_is(run, pytester, tmp_path):
    """A broken promise (pytest.fail without a traceback) is its message alone already."""
    profile = tmp_path / "gpu.toml"
    profile.write_text('[profile]\nname = "gpu"\n[gpus]\ncount = 1\n')
    pytester.makepyfile(test_gpu='''
import pytest

@pytest.mark.gpu
def test_gpu():
    """GPU-1: needs a GPU."""
''')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(profile),
                                "--results", str(pytester.path / "res"))
    result.stdout.fnmatch_lines(["*_ test_gpu _*", "profile gpu promises [[]GPUs>=1[]]: *"])
    assert Path(pytester.path / "res" / "summary.txt").exists()


def test_a_run_stopped_at_collection_says_why_not_interrupted(run, pytester):
    pytester.makepyfile(test_zero=PASSING, test_broken="raise ImportError('no torch here')\n")
    result = run()
    want = (f"dsconform: NODE {socket.gethostname()} FAILED (the run stopped at collection "
            "after 0 tests)")
    assert _verdict_lines(result) == [want]
    assert (pytester.path / "res" / "summary.txt").read_text().splitlines()[-1] == want
