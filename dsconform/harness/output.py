"""Rank output: where what ranks print goes, labelled with the test it was printed for.

Every spawned rank writes its stdout and stderr (Python's, and native code's: NCCL, c10d,
TORCH_CPP_LOG, a JIT build's compiler) into a file of its own (dsconform.harness.pool), never to
the console. The parent reads each call's part when the call ends and hands it here, with the
call's label (the test's node id): ``record`` appends it to the run's log, one line per line
printed, ``[WORKER ]rank R/W | LABEL | LINE`` (``ranks.log`` in --results, opened O_APPEND and
written one block per write, so xdist workers share it), and keeps the tail of each label for
that test's report (``take``). What the controller itself prints outside pytest's capture
(``capture``) is logged the same way, as ``controller``.

Without a configured log (the harness used outside the suite) the parent writes the lines to its
own stderr, where a test's captured output holds them.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What a test's report keeps of its ranks' output: the last this many characters per test.
KEPT_CHARS = 64 * 1024

#: The label of output printed outside any test. Labels in parentheses (this one, ranks
#: starting in the background) go to the log only, never to a test's report.
NO_TEST = "(no test)"


@dataclass
class _Sink:
    path: Path | None
    fd: int | None
    worker: str
    keep: bool
    kept: dict[str, str] = field(default_factory=dict)


_SINKS: list[_Sink] = []  # a pytester run inside a run pushes its own and pops it at its end
_LOCK = threading.Lock()
_LOCAL = threading.local()


def configure(path: Path | None, *, worker: str = "", truncate: bool = False,
              keep: bool = True) -> _Sink:
    """Send rank output to ``path`` (None: keep it for reports only) until ``release(sink)``.
    worker: a prefix naming the xdist worker ("gw0"); truncate: start the file empty (the
    process that owns the run, before any worker writes)."""
    fd = None
    if path is not None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        fd = os.open(path, flags, 0o644)
    sink = _Sink(Path(path) if path is not None else None, fd, worker, keep)
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


def log_path() -> Path | None:
    """The file rank output goes to now (None: none configured)."""
    with _LOCK:
        return _SINKS[-1].path if _SINKS else None


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
    label = getattr(_LOCAL, "label", None)
    if label:
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
        if sink is None:
            block = "".join(f"{who} | {label} | {ln}\n" for ln in lines)
            with contextlib.suppress(Exception):
                sys.stderr.write(block)
            return
        prefix = f"{sink.worker} " if sink.worker else ""
        if sink.fd is not None:
            block = "".join(f"{prefix}{who} | {label} | {ln}\n" for ln in lines)
            with contextlib.suppress(OSError):  # a full disk must not fail the test
                os.write(sink.fd, block.encode("utf-8", errors="replace"))
        if sink.keep and not label.startswith("("):
            kept = sink.kept.get(label, "") + "".join(f"{who}: {ln}\n" for ln in lines)
            sink.kept[label] = kept[-KEPT_CHARS:]


def take(label: str) -> str:
    """What was recorded for ``label`` so far (and forget it): the tail of its output, each line
    after the rank that printed it."""
    with _LOCK:
        sink = _SINKS[-1] if _SINKS else None
        return sink.kept.pop(label, "") if sink is not None else ""


class _Redirect(io.TextIOBase):
    """A sys.stdout/sys.stderr stand-in: writes to the capture while it lasts, then to
    ``fallback``. A logger created during the capture (importing DeepSpeed creates its
    handlers) keeps whatever sys.stdout was: this object stays valid after the capture ends."""

    def __init__(self, target: io.TextIOBase, fallback: Any, fd: int) -> None:
        super().__init__()
        self._target: io.TextIOBase | None = target
        self._fallback = fallback
        self._fd = fd

    def detach_capture(self) -> None:
        self._target = None

    def _out(self) -> Any:
        return self._target if self._target is not None else self._fallback

    def write(self, s: str) -> int:
        return self._out().write(s)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self._out().flush()

    def fileno(self) -> int:
        return self._fd if self._target is not None else self._fallback.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class FdCapture:
    """Send fds 1 and 2, sys.stdout and sys.stderr, and optionally warnings, to one temporary
    file while ``capture()`` lasts; ``text`` holds what was written.

    Native code (ninja, a compiler, NCCL) writes to the fds; Python code to sys.stdout, which
    pytest may have replaced: both levels are redirected. warnings: warnings.warn calls meanwhile
    are written there too (as Python prints them), not to pytest's warnings summary."""

    def __init__(self, *, warnings_too: bool = False) -> None:
        self.text = ""
        self.warnings_too = warnings_too

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with tempfile.TemporaryFile() as sink:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            saved = [os.dup(1), os.dup(2)]
            text = io.TextIOWrapper(os.fdopen(os.dup(sink.fileno()), "wb"), encoding="utf-8",
                                    errors="replace", line_buffering=True)
            out, err = _Redirect(text, sys.stdout, 1), _Redirect(text, sys.stderr, 2)
            caught: list = []
            try:
                os.dup2(sink.fileno(), 1)
                os.dup2(sink.fileno(), 2)
                with contextlib.ExitStack() as stack:
                    stack.enter_context(contextlib.redirect_stdout(out))
                    stack.enter_context(contextlib.redirect_stderr(err))
                    if self.warnings_too:
                        # The filters in force stay (the ini's ignores apply).
                        caught = stack.enter_context(warnings.catch_warnings(record=True))
                    yield
            finally:
                for w in caught:
                    text.write(warnings.formatwarning(w.message, w.category, w.filename,
                                                      w.lineno, w.line))
                text.flush()
                out.detach_capture()
                err.detach_capture()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
                text.close()
                sink.seek(0)
                self.text = sink.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def fds_to_log() -> Iterator[None]:
    """Processes this one starts meanwhile write their fds 1 and 2 straight into the rank log
    (nothing without one): for helpers that outlive every test and print on their own, such as
    multiprocessing's resource tracker (its warnings about what killed ranks left behind come
    at the process's exit, after pytest's summary) and the fork server ranks start from."""
    with _LOCK:
        fd = _SINKS[-1].fd if _SINKS else None
    if fd is None:
        yield
        return
    with fds_to(fd):
        yield


@contextlib.contextmanager
def fds_to(fd: int) -> Iterator[None]:
    """This process's fds 1 and 2 are ``fd`` meanwhile (what processes started meanwhile
    inherit), then what they were."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in saved:
            os.close(f)


@contextlib.contextmanager
def capture(label: str, who: str = "controller", *, warnings_too: bool = True) -> Iterator[None]:
    """What this process prints meanwhile (fds 1 and 2, sys.stdout/stderr, warnings) goes to
    the rank log as ``who`` for ``label``, not to the console: the plugin's work outside
    pytest's capture (starting builds, ranks and the cell batch), a rank run in-process."""
    cap = FdCapture(warnings_too=warnings_too)
    try:
        with cap.capture():
            yield
    finally:
        record(label, who, cap.text)
