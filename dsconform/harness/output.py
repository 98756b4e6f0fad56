"""Rank output: what ranks print goes to a file per rank (dsconform.harness.pool), never to the
console; the parent hands each call's part here with its label (the test's node id). ``record``
appends it to the run's log as ``[WORKER ]rank R/W | LABEL | LINE`` (``ranks.log`` in --results,
O_APPEND, one block per write, so xdist workers share it) and keeps each label's tail for its
test's report (``take``). Without a configured log the lines go to this process's stderr."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsconform.base.fdcapture import FdCapture, fds_to

#: What a test's report keeps of its ranks' output: the last this many characters per test.
KEPT_CHARS = 64 * 1024

#: The label of output printed outside any test. Labels in parentheses (this one, ranks
#: starting in the background) go to the log only, never to a test's report.
NO_TEST = "(no test)"


@dataclass
class _Sink:
    fd: int | None
    worker: str
    kept: dict[str, str] = field(default_factory=dict)


_SINKS: list[_Sink] = []  # a pytester run inside a run pushes its own and pops it at its end
_LOCK = threading.Lock()
_LOCAL = threading.local()


def configure(path: Path | None, *, worker: str = "", truncate: bool = False) -> _Sink:
    """Send rank output to ``path`` (None: keep it for reports only) until ``release(sink)``.
    worker: a prefix naming the xdist worker ("gw0"); truncate: start the file empty (the
    process that owns the run, before any worker writes)."""
    fd = None
    if path is not None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        fd = os.open(path, flags, 0o644)
    sink = _Sink(fd, worker)
    with _LOCK:
        _SINKS.append(sink)
    return sink


def release(sink: _Sink) -> None:
    """Stop writing to this sink (the session that configured it ended)."""
    with _LOCK:
        if sink in _SINKS:
            _SINKS.remove(sink)
    if sink.fd is not None:
        with contextlib.suppress(OSError):
            os.close(sink.fd)
        sink.fd = None


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Calls made by this thread meanwhile are labelled ``label`` (a background batch's cell:
    its test's node id, not the test the main thread runs)."""
    before = getattr(_LOCAL, "label", None)
    _LOCAL.label = label
    try:
        yield
    finally:
        _LOCAL.label = before


def current_label() -> str:
    """This thread's label, else the test pytest runs now (PYTEST_CURRENT_TEST without its
    phase), else NO_TEST."""
    if label := getattr(_LOCAL, "label", None):
        return label
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0] if current else NO_TEST


def record(label: str, who: str, text: str) -> None:
    """Log ``text`` (what ``who``, e.g. "rank 1/2", printed for ``label``), one line per line."""
    if not text:
        return
    lines = text.splitlines()
    with _LOCK:
        sink = _SINKS[-1] if _SINKS else None
        prefix = f"{sink.worker} " if sink is not None and sink.worker else ""
        block = "".join(f"{prefix}{who} | {label} | {ln}\n" for ln in lines)
        if sink is None:
            with contextlib.suppress(Exception):
                sys.stderr.write(block)
            return
        if sink.fd is not None:
            with contextlib.suppress(OSError):  # a full disk must not fail the test
                os.write(sink.fd, block.encode("utf-8", errors="replace"))
        if not label.startswith("("):
            kept = sink.kept.get(label, "") + "".join(f"{who}: {ln}\n" for ln in lines)
            sink.kept[label] = kept[-KEPT_CHARS:]


def take(label: str) -> str:
    """What was recorded for ``label`` so far (and forget it): the tail of its output, each line
    after the rank that printed it."""
    with _LOCK:
        return _SINKS[-1].kept.pop(label, "") if _SINKS else ""


@contextlib.contextmanager
def fds_to_log() -> Iterator[None]:
    """Processes this one starts meanwhile write their fds 1 and 2 straight into the rank log
    (nothing without one): helpers that outlive every test and print at exit, such as
    multiprocessing's resource tracker and the fork server ranks start from."""
    with _LOCK:
        fd = _SINKS[-1].fd if _SINKS else None
    with fds_to(fd) if fd is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def capture(label: str, who: str = "controller") -> Iterator[None]:
    """What this process prints meanwhile (fds 1 and 2, sys.stdout/stderr, warnings) goes to
    the rank log as ``who`` for ``label``, not to the console: the plugin's work outside
    pytest's capture (starting builds, ranks and the cell batch), a rank run in-process."""
    cap = FdCapture(warnings_too=True)
    try:
        with cap.capture():
            yield
    finally:
        record(label, who, cap.text)
