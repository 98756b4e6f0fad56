"""When a run's start-up reached each of its steps, in seconds after pytest's process started
(as the kernel records it, so the interpreter's own start-up counts): the summary's "start-up:"
line (dsconform.plugin.recorder.Recorder.run_lines; docs/results-format.md). Steps are marked
in pytest's process, or come from the ranks' replies (dsconform.harness.rank._start_facts)."""

from __future__ import annotations

import os
import threading
import time

_LOCK = threading.Lock()
_MARKS: dict[str, float] = {}


def process_started_at(pid: int | str = "self") -> float | None:
    """time.time() at which process ``pid`` started, from /proc (10 ms resolution); None where
    /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Field 22, starttime (clock ticks after boot); the fields after the command's
        # parenthesis start at field 3.
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark(step: str, at: float | None = None, *, first: bool = True) -> None:
    """Note that the start-up reached ``step`` now (or at time.time() ``at``). first: keep the
    earliest time a step is marked (a step marked again later is not moved); otherwise the
    latest."""
    at = time.time() if at is None else at
    with _LOCK:
        old = _MARKS.get(step)
        if old is None or (at < old if first else at > old):
            _MARKS[step] = at


def marks() -> dict[str, float]:
    """Each marked step's seconds after this process started, in time order (empty where
    /proc cannot give the start)."""
    if (start := process_started_at()) is None:
        return {}
    with _LOCK:
        items = sorted(_MARKS.items(), key=lambda kv: kv[1])
    return {step: max(0.0, at - start) for step, at in items}


def line() -> str | None:
    """The summary's line, or None when nothing was marked."""
    if not (steps := marks()):
        return None
    return ("start-up (seconds after pytest's process started): "
            + ", ".join(f"{step} {secs:.1f}" for step, secs in steps.items()))


def reset() -> None:
    """Forget every mark (the project's own tests)."""
    with _LOCK:
        _MARKS.clear()
