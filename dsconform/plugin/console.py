"""What a run shows on the console beside pytest's own lines: failures as the check states them
(this package's, pytest's and pluggy's frames left out unless -v, --tb or --showlocals asks for
pytest's full report; a failing rank's traceback is part of the check's message), a line every
PROGRESS_S while a test waits for an op's build, and the node's verdict after the short summary.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pluggy
import pytest

import dsconform
from dsconform.harness import output as rank_output
from dsconform.plugin.items import is_xdist_worker

#: Frames of these folders are the harness's and the test runner's, not the check's.
INTERNAL = tuple(str(folder) + "/" for folder in (
    Path(dsconform.__file__).parent, Path(pytest.__file__).parents[1] / "_pytest",
    Path(pluggy.__file__).parent))

#: The most lines of rank output a short failure report shows.
RANK_LINES_SHOWN = 40


def check_frames(excinfo: pytest.ExceptionInfo) -> Any:
    """The traceback a short report shows: frames that are not hidden (``__tracebackhide__``)
    and not internal; where every frame is internal, the innermost one, which raised."""
    shown = excinfo.traceback.filter(excinfo)
    own = shown.filter(lambda entry: not str(entry.path).startswith(INTERNAL))
    return own if len(own) else (shown or excinfo.traceback)[-1:]


def shortens_failures(config: pytest.Config) -> bool:
    """Short reports unless -v, --tb, --showlocals or --full-trace asks pytest for more."""
    return (config.get_verbosity() < 1 and config.getoption("tbstyle", "auto") == "auto"
            and not config.getoption("showlocals", False)
            and not config.getoption("fulltrace", False))


def rank_lines(text: str, *, short: bool) -> str:
    """A failure report's rank output: in a short report its last RANK_LINES_SHOWN lines, the
    ones nearest the failure (a GPU rank's DeepSpeed start-up alone prints dozens)."""
    lines = text.splitlines()
    if not short or len(lines) <= RANK_LINES_SHOWN:
        return text
    return "\n".join([f"(the last {RANK_LINES_SHOWN} of {len(lines)} lines; all of them: "
                      f"ranks.log in --results, or -v)",
                      *lines[-RANK_LINES_SHOWN:]]) + "\n"


class Console:
    """Registered in pytest_configure, in the controller and in every xdist worker (where the
    reports are made)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.short = shortens_failures(config)
        self.wrote = False  # since the last test report: its file's line must start again
        self._say_lock = threading.Lock()

    def say(self, line: str) -> None:
        """``dsconform: LINE`` on the terminal from any thread (the soak's sampler thread while
        the test waits for its ranks), with the output capture suspended; nothing in an xdist
        worker."""
        plugins = self.config.pluginmanager
        reporter = plugins.get_plugin("terminalreporter")
        if reporter is None or is_xdist_worker(self.config):
            return
        capture = plugins.get_plugin("capturemanager")
        with self._say_lock, (capture.global_and_fixture_disabled() if capture
                              else contextlib.nullcontext()):
            reporter.write_line(f"dsconform: {line}")  # write_line ends pytest's line first
        self.wrote = True

    def progress(self, progress: Any) -> None:
        """ParallelBuilds.on_progress: its line, only from the main thread, which pytest's own
        output comes from (a background wait, the cell batch's, stays silent)."""
        if threading.current_thread() is threading.main_thread():
            self.say(progress.line())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """After a build's progress lines the waiting test's outcome starts a line that names
        its file again, as pytest's lines do (with -v pytest names the test again itself)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if self.wrote and reporter is not None:
            self.wrote = False
            if reporter.showfspath and reporter.verbosity <= 0:
                reporter.write_fspath_result(report.nodeid, "")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        """A failing test's report shows what its ranks printed (ranks.log holds every
        test's); a test's part is dropped once its report is made."""
        report = yield
        if report.failed or report.when == "teardown":
            text = rank_output.take(item.nodeid)
            if text and report.failed:
                report.sections.append((f"Captured rank stdout/stderr {report.when}",
                                        rank_lines(text, short=self.short)))
        excinfo = call.excinfo
        # The test's own failure; a setup's or teardown's error keeps pytest's report (a
        # fixture not found is reported as its message, not a traceback).
        if (self.short and report.failed and report.when == "call" and excinfo is not None
                and not (isinstance(excinfo.value, pytest.fail.Exception)
                         and not excinfo.value.pytrace)):  # already its message alone
            report.longrepr = excinfo.getrepr(style="short", tbfilter=check_frames,
                                              funcargs=False, showlocals=False)
        return report

    # Outermost (tryfirst) around the terminal reporter's own wrapper: what follows the yield
    # comes after pytest's short test summary, before its final counts.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus: int,
                                config: pytest.Config):
        result = yield
        recorder = config.pluginmanager.get_plugin("dsconform-recorder")
        if line := getattr(recorder, "verdict", None):
            passed = line.endswith(" PASSED")
            terminalreporter.write_line(line, bold=True, green=passed, red=not passed)
        return result
