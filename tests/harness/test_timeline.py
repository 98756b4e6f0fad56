"""The start-up line's clock (dsconform.harness.timeline): seconds after this process started,
as /proc says, the earliest mark of a step kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from dsconform.harness import timeline


def test_the_process_start_is_the_kernels():
    """A new interpreter's first statement runs a little after its process started (psutil's
    create_time is whole seconds of boot time off)."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; print(time.time(), flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        first_statement = float(child.stdout.readline())
        started = timeline.process_started_at(child.pid)
    finally:
        child.kill()
        child.wait()
    assert before - 0.02 <= started <= first_statement, (before, started, first_statement)
    assert timeline.process_started_at(2 ** 31 - 1) is None  # no such process


def test_marks_are_seconds_after_the_start_in_time_order():
    timeline.reset()
    start = timeline.process_started_at()
    timeline.mark("second", start + 2.0)
    timeline.mark("first", start + 1.0)
    timeline.mark("first", start + 1.5)  # marked again later: the earliest is kept
    timeline.mark("last", start + 3.0, first=False)
    timeline.mark("last", start + 4.0, first=False)  # the latest is kept
    steps = timeline.marks()
    assert list(steps) == ["first", "second", "last"]
    assert [round(v, 2) for v in steps.values()] == [1.0, 2.0, 4.0]
    assert timeline.line() == ("start-up (seconds after pytest's process started): "
                               "first 1.0, second 2.0, last 4.0")
    timeline.reset()
    assert timeline.line() is None


def test_a_mark_now_is_after_the_start():
    timeline.reset()
    timeline.mark("now")
    now = timeline.marks()["now"]
    assert 0 < now <= time.time() - psutil.Process(os.getpid()).create_time() + 0.1
    timeline.reset()
