"""Build the ops a run needs as it starts: the awaited build first, with the cores.

A cold run's time goes to JIT builds its tests wait for, and builds sharing the cores out
evenly each take about twice their time alone (docs/performance.md#op-builds). So the ops are
built longest first (``longest_first``), one process per op, the first with every core
(MAX_JOBS), the others started while it leaves cores idle (an op of three source files keeps
three busy), each at a lower priority than the builds already running (nice), with every core
too: they take what the awaited build leaves, and all of it once it is done. Ops already in
the extensions cache are not built again (``skip_cached``: the run's warm start costs nothing).

Tests go on meanwhile: those that need no op run; the op tests wait for their op's build and
only load and check it; a build that failed is reported by its op's test, with the diagnosis,
from this build's result (no second attempt). Ranks that need an op wait for the build in
torch's own lock, which the build process holds open while it works (dsconform.base.buildlock).
``dsconform build-ops`` (dsconform.ops.build_cli) runs the same builds ahead of a run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MARK = "@@dsconform-build@@"
_CHILD = f"""
import json, os, sys
if int(sys.argv[2]):
    os.nice(int(sys.argv[2]))  # its compiler jobs inherit it
from dsconform.ops.load import load_op
from dsconform.ops.diagnose import format_failure
r = load_op(sys.argv[1])
out = {{**r.summary(), "failure": None if r.loaded else format_failure(r), "log_tail": r.log_tail}}
print({_MARK!r} + json.dumps(out, default=str), flush=True)
"""

#: How often the scheduler looks at the running builds.
POLL_S = 0.5
#: A build is judged by its cores only once ninja has run this long (the build process imports
#: torch and DeepSpeed and probes the compiler first, on one core; ninja starts the jobs).
SETTLE_S = 2.0
#: A build that started no compiler job by then (a load that found its op built) is judged too.
SETTLE_MAX_S = 30.0
#: How often the scheduler's readings are kept for the results (ParallelBuilds.readings).
READING_EVERY_S = 2.0
#: The next build starts when at least this share of the cores is idle.
IDLE_SHARE = 0.25
#: Each build started beside running ones is this much nicer than the nicest of them.
NICE_STEP = 10
#: How often a caller that waits for a build hears which op it waits for and how long the
#: builds have run (``on_progress``): a cold build takes minutes of silence otherwise.
PROGRESS_S = 15.0

#: The ops a run of the suites loads on each accelerator beside the profile's promises, for
#: ``dsconform build-ops`` (tests/ops/test_build_ops.py holds it to the suites' requires(op=...)):
#: on CPU, DeepSpeed's shm comm op, which every rank's init_distributed builds.
RUN_OPS = {
    "cuda": ("fused_adam", "cpu_adam", "async_io", "gds", "utils", "cpu_adagrad", "cpu_lion",
             "fused_lion", "fused_lamb"),
    "cpu": ("deepspeed_shm_comm", "fused_adam", "cpu_adam", "async_io", "cpu_adagrad",
            "cpu_lion"),
}
#: Seconds each op's build takes alone with every core (docs/performance.md#op-builds): builds
#: go longest first, so that the longest does not start last.
TYPICAL_BUILD_S = {"gds": 57.4, "async_io": 51.7, "fused_adam": 41.7, "cpu_adam": 41.2,
                   "utils": 25.0}


def longest_first(ops: Sequence[str]) -> list[str]:
    """``ops`` by TYPICAL_BUILD_S, longest first; ops it does not list keep their order, last."""
    return sorted(dict.fromkeys(ops), key=lambda op: -TYPICAL_BUILD_S.get(op, 0.0))


#: Of RUN_OPS, those the acceptance tier loads only where the profile promises them: gds
#: (NVME-GDS-1 is marked promised_ops_only, NVME-GDS-2 runs on paths with gds = true).
PROMISED_ONLY = ("gds",)

#: Of RUN_OPS, those only the nightly tier's cells load on GPUs (the optimizer suite's Adagrad,
#: Lion and LAMB ops): an acceptance run neither builds nor waits for them unless promised.
NIGHTLY_ONLY = ("cpu_adagrad", "cpu_lion", "fused_lion", "fused_lamb")


def acceptance_ops(accelerator: str, promised: Sequence[str]) -> list[str]:
    """The ops ``pytest -m gpu`` loads on this accelerator: the promised ones, then RUN_OPS's
    but those of PROMISED_ONLY and NIGHTLY_ONLY the profile does not promise."""
    return list(dict.fromkeys([*promised, *(
        op for op in RUN_OPS.get(accelerator, ())
        if op not in PROMISED_ONLY + NIGHTLY_ONLY or op in promised)]))


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def is_cached(op: str, ext_dir: Path) -> bool:
    """Whether the extensions cache holds a current build of ``op``: torch's NAME/NAME.so, no
    older than any source its build.ninja compiles. A reinstalled DeepSpeed (the same release)
    writes newer sources, and ninja rebuilds the op in whichever process loads it next."""
    built = Path(ext_dir) / op / f"{op}.so"
    try:
        built_at = built.stat().st_mtime
        rules = (built.parent / "build.ninja").read_text()
    except OSError:
        return built.exists()
    for line in rules.splitlines():
        if not line.startswith("build ") or ":" not in line:
            continue
        for token in line.split(":", 1)[1].split()[1:]:  # after the rule: the inputs
            if token in ("|", "||"):
                break
            source = Path(token)
            try:
                if "$" not in token and source.is_absolute() and \
                        source.stat().st_mtime > built_at:
                    return False
            except OSError:
                continue
    return True


class TreeMeter:
    """How many cores a build's process tree keeps busy (psutil): the cores its CPU time since
    the last reading used (the live processes' own time and that of the children they reaped,
    so a compiler job that ended still counts, once), or, where more, how many of its processes
    are running or waiting for a core (a machine busy with other work gives a build less CPU
    time than it asks for)."""

    def __init__(self, driver: str = "ninja") -> None:
        self.driver = driver  # the process that starts the compiler jobs
        self._last: dict[int, tuple[float, float]] = {}
        self._driver_seen: dict[int, float] = {}

    def _cpu_seconds(self, pid: int) -> tuple[float, bool, int] | None:
        import psutil

        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return None
        total, driving, runnable = 0.0, False, 0
        for proc in procs:
            try:
                t = proc.cpu_times()
                driving = driving or proc.name() == self.driver
                runnable += proc.status() in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP)
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total, driving, runnable

    def __call__(self, build: Build) -> tuple[bool, float]:
        """(settled: its compiler jobs have started, or it never starts any; busy cores)."""
        now = time.monotonic()
        found = self._cpu_seconds(build.proc.pid)
        if found is None:
            return True, 0.0
        total, driving, runnable = found
        if driving:
            self._driver_seen.setdefault(build.proc.pid, now)
        seen = self._driver_seen.get(build.proc.pid)
        settled = (seen is not None and now - seen >= SETTLE_S) \
            or now - build.started >= SETTLE_MAX_S
        last = self._last.get(build.proc.pid)
        self._last[build.proc.pid] = (now, total)
        if last is None or now <= last[0]:
            return False, float(runnable)
        return settled, max(float(runnable), (total - last[1]) / (now - last[0]))


@dataclass
class Build:
    op: str
    proc: subprocess.Popen
    started: float
    jobs: int
    nice: int
    started_at: float = 0.0  # seconds after the first build started
    result: dict[str, Any] | None = None
    output: str = ""
    chunks: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None
    ended: float | None = None

    @property
    def running(self) -> bool:
        return self.ended is None and self.proc.poll() is None

    def drain(self) -> None:
        """Read the build's output as it comes: a build that prints more than a pipe holds
        (64 KiB of compiler warnings) would otherwise stop until its op's test reads it, and
        hold the extension lock that ranks needing the op wait on."""
        for line in self.proc.stdout:
            self.chunks.append(line)


def _command(op: str, nice: int) -> list[str]:
    return [sys.executable, "-c", _CHILD, op, str(nice)]


@dataclass
class Progress:
    """What a wait for a build says every PROGRESS_S (ParallelBuilds.on_progress): the op it
    waits for, how long it has waited, and each running build with its seconds so far."""
    op: str
    waited_s: float
    building: list[tuple[str, float]]
    pending: bool  # the op's own build has not started yet

    def line(self) -> str:
        """``op cpu_adam: building, 45 s so far`` (and the builds beside it)."""
        own = dict(self.building)
        if self.op in own:
            text = f"op {self.op}: building, {own.pop(self.op):.0f} s so far"
        elif self.pending:
            text = f"op {self.op}: waiting {self.waited_s:.0f} s for its build to start"
        else:
            text = f"op {self.op}: waiting {self.waited_s:.0f} s for its build"
        if own:
            text += "; beside it " + ", ".join(f"{op} {secs:.0f} s" for op, secs in own.items())
        return text


@dataclass
class _Ticker:
    """When a wait (or wait_all's several) next reports its progress."""
    started: float = field(default_factory=time.monotonic)
    next_at: float = field(default_factory=lambda: time.monotonic() + PROGRESS_S)


@dataclass
class ParallelBuilds:
    """One build process per op, started in ``order`` as the cores allow (the module's
    docstring); ``wait(op)`` returns its result (``loaded``, ``build_seconds``, ``built_now``,
    ``failure``, ``jobs``, ``nice``, ``wall_seconds`` ...), None for an op this run did not
    build (not asked for, or already in the cache)."""
    order: list[str]
    cores: int
    command: Callable[[str, int], list[str]] = _command
    meter: Callable[[Build], tuple[bool, float]] = field(default_factory=TreeMeter)
    on_event: Callable[[str, str, dict[str, Any]], None] | None = None
    #: Told every PROGRESS_S while a caller waits for a build (in the waiting thread).
    on_progress: Callable[[Progress], None] | None = None
    cached: list[str] = field(default_factory=list)  # in the cache at the start
    builds: dict[str, Build] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    closed: bool = False
    t0: float = 0.0
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None
    #: What the scheduler read while it waited to start a build, every READING_EVERY_S:
    #: (seconds after the first build started, {op: (settled, busy cores)}), for the results.
    readings: list[tuple[float, dict[str, tuple[bool, float]]]] = field(default_factory=list)

    @classmethod
    def start(cls, ops: Sequence[str], cores: int | None = None, *, skip_cached: bool = False,
              ext_dir: Path | None = None, share_cpu_info: bool = True,
              **kw: Any) -> ParallelBuilds:
        """Start building ``ops`` in this order (the first is the most awaited) with ``cores``
        (default: this process's); skip_cached: leave out ops the extensions cache holds;
        share_cpu_info: settle py-cpuinfo's answer first, for the builds to inherit (it waits
        for the answer: a second where nothing asked yet; each build asks once otherwise)."""
        order = list(dict.fromkeys(ops))
        if ext_dir is None:
            from dsconform.ops.cache import ensure_extensions_dir
            ext_dir = ensure_extensions_dir()
        cached = [op for op in order if is_cached(op, ext_dir)]
        if skip_cached:
            order = [op for op in order if op not in cached]
        self = cls(order=order, cores=max(1, cores or available_cores()), cached=cached, **kw)
        self.pending = list(order)
        if self.pending and share_cpu_info:  # each build's CPU question answered from here
            from dsconform.base import cpu_info
            cpu_info.share()
        self.t0 = time.monotonic()  # after it: started_at counts from the first build
        if self.pending:
            self._launch()
        return self

    def _launch(self) -> None:
        """Start the first pending build where none runs, and the scheduler's thread (under
        self.lock, or before another thread sees this object)."""
        if not any(b.ended is None for b in self.builds.values()):
            self._start_next()
        self.thread = threading.Thread(target=self._schedule, name="dsconform-op-builds",
                                       daemon=True)
        self.thread.start()

    @property
    def jobs_per_op(self) -> int:
        """MAX_JOBS each build gets: every core (the nice level orders them)."""
        return self.cores

    def _start_next(self, op: str | None = None) -> None:
        with self.lock:
            if self.closed or not self.pending:
                return
            op = op or self.pending[0]
            self.pending.remove(op)
            running = [b for b in self.builds.values() if b.ended is None]
            nice = min(19, max(b.nice for b in running) + NICE_STEP) if running else 0
            env = {**os.environ, "MAX_JOBS": str(self.cores), "PYTHONUNBUFFERED": "1"}
            # A process group of its own (killed whole), not a session: with the kernel's
            # autogroups a session gets its own share of the CPU, whatever its nice level.
            proc = subprocess.Popen(self.command(op, nice), env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    process_group=0)
            now = time.monotonic()
            b = self.builds[op] = Build(op, proc, now, self.cores, nice, now - self.t0)
            b.reader = threading.Thread(target=b.drain, name=f"dsconform-build-{op}", daemon=True)
            b.reader.start()
        self._event(op, "start", {"jobs": b.jobs, "nice": nice, "started_at": b.started_at,
                                  "beside": [r.op for r in running],
                                  "cached": op in self.cached})

    def _at_lowest_priority(self) -> bool:
        """Whether the running builds have reached nice 19, where the next would start too."""
        with self.lock:
            return any(b.nice >= 19 for b in self.builds.values() if b.ended is None)

    def _event(self, op: str, what: str, info: dict[str, Any]) -> None:
        with self.changed:
            self.changed.notify_all()
        if self.on_event is not None:
            try:
                self.on_event(op, what, info)
            except Exception:  # a progress printer must not stop the builds
                pass

    def _schedule(self) -> None:
        """Start the next build when nothing builds, or when the running builds (each settled)
        leave IDLE_SHARE of the cores idle; finish each build's result as it ends."""
        idle_before = False
        while not self.closed:
            for b in list(self.builds.values()):
                if b.ended is None and b.proc.poll() is not None:
                    self._finish(b)
            with self.lock:
                running = [b for b in self.builds.values() if b.ended is None]
                if not self.pending and not running:
                    self.thread = None  # extend() starts another for ops it adds
                    return
            loads = [op for op in self.pending if op in self.cached]
            if self.pending:
                if not running or loads:  # an op in the cache only loads: one core, seconds
                    self._start_next(None if not running else loads[0])
                    idle_before = False
                else:
                    readings = [self.meter(b) for b in running]
                    busy = sum(r[1] for r in readings)
                    t = time.monotonic() - self.t0
                    if not self.readings or t - self.readings[-1][0] >= READING_EVERY_S:
                        self.readings.append((round(t, 1), {
                            b.op: (r[0], round(r[1], 1)) for b, r in zip(running, readings)}))
                    idle = all(r[0] for r in readings) and \
                        self.cores - busy >= max(1.0, IDLE_SHARE * self.cores)
                    if idle and idle_before:  # two readings in a row: not a moment's lull
                        self._start_next()
                        idle = False
                        if self._at_lowest_priority():
                            # The rest would start at this nice level too, each once the cores
                            # are idle again: on 1xH200 the last (utils, one source file) ended
                            # 13 s after every other build, and the measurements wait for all
                            # of them. They share what the builds before them leave.
                            while self.pending:
                                self._start_next()
                    idle_before = idle
            time.sleep(POLL_S)

    def _finish(self, b: Build, failure: str | None = None) -> dict[str, Any]:
        with self.lock:
            if b.result is not None:
                return b.result
            b.output = self._output(b)
            b.ended = b.ended or time.monotonic()
            line = next((ln for ln in b.output.splitlines() if ln.startswith(_MARK)), None)
            if failure is not None or line is None:
                b.result = {"op": b.op, "loaded": False, "log_tail": b.output[-4000:],
                            "failure": failure or (
                                f"op {b.op}: the build process exited {b.proc.returncode} "
                                "without a result (a crash while building or loading)")}
            else:
                b.result = json.loads(line[len(_MARK):])
            b.result.update(wall_seconds=b.ended - b.started, jobs=b.jobs, nice=b.nice,
                            started_at=b.started_at)
        self._event(b.op, "done", b.result)
        return b.result

    def wait(self, op: str, timeout_s: float = 900, *, ticker: _Ticker | None = None
             ) -> dict[str, Any] | None:
        """The build's result; None when this run does not build ``op``. A build that dies or
        runs past ``timeout_s`` (from now) is a result too (``loaded`` False, the reason).
        Meanwhile ``on_progress`` hears every PROGRESS_S how it goes."""
        deadline = time.monotonic() + timeout_s
        ticker = ticker or _Ticker()
        while True:
            with self.lock:  # _start_next moves an op from pending to builds under it
                if op not in self.pending or self.closed:
                    break
            until = deadline if self.on_progress is None else min(deadline, ticker.next_at)
            with self.changed:
                woke = self.changed.wait(min(1.0, max(0.01, until - time.monotonic())))
            if not woke and time.monotonic() >= deadline:
                break
            self._tick(op, ticker)
        b = self.builds.get(op)
        if b is None:
            if op in self.pending:
                return {"op": op, "loaded": False, "log_tail": "",
                        "failure": f"op {op}: its build did not start within {timeout_s:.0f} s"}
            return None
        while b.result is None:
            until = deadline if self.on_progress is None else min(deadline, ticker.next_at)
            try:
                b.proc.wait(timeout=max(0.01, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                if time.monotonic() < deadline:
                    self._tick(op, ticker)
                    continue
                self._kill(b)
                return self._finish(b, f"op {op}: the parallel build did not finish within "
                                       f"{timeout_s:.0f} s")
            return self._finish(b)
        return b.result

    def _tick(self, op: str, ticker: _Ticker) -> None:
        now = time.monotonic()
        if self.on_progress is None or now < ticker.next_at:
            return
        ticker.next_at = now + PROGRESS_S
        with self.lock:
            building = [(b.op, now - b.started) for b in self.builds.values() if b.running]
            pending = op in self.pending
        try:
            self.on_progress(Progress(op, now - ticker.started, building, pending))
        except Exception:  # a progress printer must not stop the wait
            pass

    @staticmethod
    def _output(b: Build) -> str:
        if b.reader is not None:
            b.reader.join(timeout=10)  # the pipe closes when the process (group) has exited
        return "".join(b.chunks)

    def finished(self, op: str) -> bool:
        """Whether ``wait(op)`` would return at once (no build of op, or it has ended)."""
        if op in self.pending:
            return False
        b = self.builds.get(op)
        return b is None or b.result is not None or b.proc.poll() is not None

    def wait_all(self, timeout_s: float = 3600) -> dict[str, dict[str, Any]]:
        """Every build's result (dsconform build-ops)."""
        ticker = _Ticker()  # one line every PROGRESS_S, whichever build it waits for
        return {op: self.wait(op, timeout_s, ticker=ticker) for op in self.order}

    def timings(self) -> dict[str, Any]:
        """The builds this run made, for its results: each op's build seconds (DeepSpeed's
        build and load, in the build process) and its wall seconds, jobs, nice level and start
        (seconds after the first build started); the ops found in the cache."""
        builds = []
        for op in self.order:
            b = self.builds.get(op)
            r = b.result if b is not None else None
            if r is None:
                continue
            builds.append({"op": op, "loaded": bool(r.get("loaded")),
                           "built_now": bool(r.get("built_now")),
                           "build_seconds": round(float(r.get("build_seconds") or 0.0), 2),
                           "wall_seconds": round(float(r["wall_seconds"]), 2),
                           "jobs": r["jobs"], "nice": r["nice"],
                           "started_at": round(r["started_at"], 2)})
        return {"order": list(self.order), "cores": self.cores,
                "cached": [op for op in self.cached if op not in self.order],
                "builds": builds,
                "build_seconds": {b["op"]: b["build_seconds"] for b in builds},
                "readings": [[t, {op: list(r) for op, r in ops.items()}]
                             for t, ops in self.readings]}

    def _kill(self, b: Build) -> None:
        if b.proc.poll() is None:
            try:
                os.killpg(b.proc.pid, signal.SIGKILL)  # the build and its compiler jobs
            except (ProcessLookupError, PermissionError):
                b.proc.kill()
        b.proc.wait()

    def close(self) -> None:
        """Stop builds still running and start no more (the run ended or was interrupted). A
        killed build leaves its lock behind; the next run removes it (dsconform.base.buildlock)."""
        with self.lock:
            self.closed = True
            builds = list(self.builds.values())
        with self.changed:
            self.changed.notify_all()
        for b in builds:
            if b.result is None:
                self._kill(b)
                self._output(b)


def summary_line(timings: dict[str, Any]) -> str | None:
    """One line for the run's summary: each build with its seconds, jobs and start; the cached
    ops (None when the run built nothing)."""
    parts = []
    for b in timings.get("builds", []):
        state = "FAILED" if not b["loaded"] else "built" if b["built_now"] else "loaded"
        parts.append(f"{b['op']} {b['wall_seconds']:.1f} s ({state}, MAX_JOBS={b['jobs']}"
                     + (f", nice {b['nice']}" if b["nice"] else "")
                     + (f", started at {b['started_at']:.0f} s" if b["started_at"] >= 0.5 else "")
                     + ")")
    if timings.get("cached"):
        parts.append(f"in the cache: {', '.join(timings['cached'])}")
    return ("op builds: " + "; ".join(parts)) if parts else None
