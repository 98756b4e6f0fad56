"""fd capture: what this process writes to fds 1 and 2, sys.stdout and sys.stderr (and
optionally warnings) sent to one place while a block runs, native code's output included (ninja,
a compiler, NCCL). dsconform.harness.output logs it by test; the op builders keep it for their
error messages."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any


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
