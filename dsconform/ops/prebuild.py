"""Build the ops a run needs as it starts (docs/performance.md#op-builds): one process per op,
all at once, each with every core (MAX_JOBS), in ``longest_first`` order of priority (nice 0,
then 10, then 19); ops the extensions cache holds are not built again (``skip_cached``). Tests
that need no op run meanwhile; an op's tests wait for its build and report a failure from its
result; ranks that need an op wait in torch's build lock (dsconform.base.buildlock).
``dsconform build-ops`` (dsconform.tools.build_ops) runs the same builds ahead of a run."""

from __future__ import annotations

import contextlib
import itertools
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

#: Each build runs this much nicer than the one before it, up to 19.
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
    for line in rules.splitlines():  # "build OUT: RULE IN... | IMPLICIT || ORDER-ONLY"
        if line.startswith("build ") and ":" in line:
            inputs = line.split(":", 1)[1].split()[1:]
            for token in itertools.takewhile(lambda t: t not in ("|", "||"), inputs):
                with contextlib.suppress(OSError):
                    if "$" not in token and os.path.isabs(token) and \
                            os.stat(token).st_mtime > built_at:
                        return False
    return True


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
    failure: str | None = None  # why the run stopped it (its timeout)
    follower: threading.Thread | None = None
    ended: float | None = None


def _command(op: str, nice: int) -> list[str]:
    return [sys.executable, "-c", _CHILD, op, str(nice)]


@dataclass
class Progress:
    """What a wait for a build says every PROGRESS_S (ParallelBuilds.on_progress): the op it
    waits for, how long it has waited, and each running build with its seconds so far."""
    op: str
    waited_s: float
    building: list[tuple[str, float]]

    def line(self) -> str:
        """``op cpu_adam: building, 45 s so far`` (and the builds beside it)."""
        own = dict(self.building)
        if self.op in own:
            text = f"op {self.op}: building, {own.pop(self.op):.0f} s so far"
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
    """One build process per op, all started at once, in ``order`` of priority (the module's
    docstring); ``wait(op)`` returns its result (``loaded``, ``build_seconds``, ``built_now``,
    ``failure``, ``jobs``, ``nice``, ``wall_seconds`` ...), None for an op this run did not
    build (not asked for, or already in the cache)."""
    order: list[str]
    cores: int
    command: Callable[[str, int], list[str]] = _command
    on_event: Callable[[str, str, dict[str, Any]], None] | None = None
    #: Told every PROGRESS_S while a caller waits for a build (in the waiting thread).
    on_progress: Callable[[Progress], None] | None = None
    cached: list[str] = field(default_factory=list)  # in the cache at the start
    builds: dict[str, Build] = field(default_factory=dict)
    closed: bool = False
    t0: float = 0.0
    lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def start(cls, ops: Sequence[str], cores: int | None = None, *, skip_cached: bool = False,
              ext_dir: Path | None = None, share_cpu_info: bool = True,
              **kw: Any) -> ParallelBuilds:
        """Start building ``ops``, the first the most awaited, with ``cores`` (default: this
        process's); skip_cached: leave out ops the extensions cache holds (else they only
        load, at nice NICE_STEP); share_cpu_info: settle py-cpuinfo's answer first, for the
        builds to inherit (each build asks once otherwise, docs/performance.md)."""
        self = cls(order=[], cores=max(1, cores or available_cores()), **kw)
        self.add(ops, skip_cached=skip_cached, ext_dir=ext_dir, share_cpu_info=share_cpu_info)
        return self

    def add(self, ops: Sequence[str], *, skip_cached: bool = True, ext_dir: Path | None = None,
            share_cpu_info: bool = True) -> None:
        """Start building those of ``ops`` not asked for yet, after the builds started so far
        in priority (``start``'s arguments)."""
        if ext_dir is None:
            from dsconform.ops.cache import ensure_extensions_dir
            ext_dir = ensure_extensions_dir()
        new = [op for op in dict.fromkeys(ops) if op not in self.order and op not in self.cached]
        cached = [op for op in new if is_cached(op, ext_dir)]
        self.cached += cached
        if skip_cached:
            new = [op for op in new if op not in cached]
        if new and share_cpu_info:  # each build's CPU question answered from here
            from dsconform.base import cpu_info
            cpu_info.share()
        if new and not self.builds:
            self.t0 = time.monotonic()  # after it: started_at counts from the first build
        self.order += new
        to_build = [op for op in self.order if op not in self.cached]
        for op in new:
            nice = min(19, NICE_STEP * to_build.index(op)) if op in to_build else NICE_STEP
            self._start(op, nice)

    def _start(self, op: str, nice: int) -> None:
        with self.lock:
            running = [b.op for b in self.builds.values() if b.ended is None]
            env = {**os.environ, "MAX_JOBS": str(self.cores), "PYTHONUNBUFFERED": "1"}
            # A process group of its own (killed whole), not a session: with the kernel's
            # autogroups a session gets its own share of the CPU, whatever its nice level.
            proc = subprocess.Popen(self.command(op, nice), env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    process_group=0)
            now = time.monotonic()
            b = Build(op, proc, now, self.cores, nice, now - self.t0)
            b.follower = threading.Thread(target=self._finish, args=(b,),
                                          name=f"dsconform-build-{op}", daemon=True)
            b.follower.start()
            self.builds[op] = b  # followed already: wait() joins its follower
        self._event(op, "start", {"jobs": b.jobs, "nice": nice, "started_at": b.started_at,
                                  "beside": running, "cached": op in self.cached})

    def _event(self, op: str, what: str, info: dict[str, Any]) -> None:
        if self.on_event is not None and not self.closed:
            with contextlib.suppress(Exception):  # a progress printer must not stop the builds
                self.on_event(op, what, info)

    def _finish(self, b: Build) -> None:
        """Read the build's output as it comes (a build that prints more than a pipe holds,
        64 KiB of compiler warnings, would otherwise stop there and hold the extension lock
        that ranks needing the op wait on), then finish its result as it ends."""
        b.output = "".join(b.proc.stdout)
        b.proc.wait()
        with self.lock:
            b.ended = time.monotonic()
            line = next((ln for ln in b.output.splitlines() if ln.startswith(_MARK)), None)
            if b.failure is not None or line is None:
                result = {"op": b.op, "loaded": False, "log_tail": b.output[-4000:],
                          "failure": b.failure or (
                              f"op {b.op}: the build process exited {b.proc.returncode} "
                              "without a result (a crash while building or loading)")}
            else:
                result = json.loads(line[len(_MARK):])
            result.update(wall_seconds=b.ended - b.started, jobs=b.jobs, nice=b.nice,
                          started_at=b.started_at, cached=b.op in self.cached)
        # The printer says how the build ended before a wait() returns it (build-ops' last line).
        self._event(b.op, "done", result)
        b.result = result  # wait() joins this thread: a result waits for its event

    def wait(self, op: str, timeout_s: float = 900, *, ticker: _Ticker | None = None
             ) -> dict[str, Any] | None:
        """The build's result; None when this run does not build ``op``. A build that dies or
        runs past ``timeout_s`` (from now) is a result too (``loaded`` False, the reason).
        Meanwhile ``on_progress`` hears every PROGRESS_S how it goes."""
        if (b := self.builds.get(op)) is None:
            return None
        deadline, ticker = time.monotonic() + timeout_s, ticker or _Ticker()
        while b.follower.is_alive():
            if time.monotonic() >= deadline:
                b.failure = f"op {op}: the parallel build did not finish within {timeout_s:.0f} s"
                self._kill(b)
                b.follower.join()
                break
            until = deadline if self.on_progress is None else min(deadline, ticker.next_at)
            b.follower.join(min(1.0, max(0.01, until - time.monotonic())))
            self._tick(op, ticker)
        return b.result

    def _tick(self, op: str, ticker: _Ticker) -> None:
        now = time.monotonic()
        if self.on_progress is None or now < ticker.next_at:
            return
        ticker.next_at = now + PROGRESS_S
        with self.lock:
            building = [(b.op, now - b.started) for b in self.builds.values()
                        if b.ended is None and b.proc.poll() is None]
        with contextlib.suppress(Exception):  # a progress printer must not stop the wait
            self.on_progress(Progress(op, now - ticker.started, building))

    def finished(self, op: str) -> bool:
        """Whether ``wait(op)`` would return at once (no build of op, or it has ended)."""
        b = self.builds.get(op)
        return b is None or b.result is not None or b.proc.poll() is not None

    def wait_all(self, timeout_s: float = 3600) -> dict[str, dict[str, Any]]:
        """Every build's result (dsconform build-ops)."""
        ticker = _Ticker()  # one line every PROGRESS_S, whichever build it waits for
        return {op: self.wait(op, timeout_s, ticker=ticker) for op in self.order}

    def timings(self) -> dict[str, Any]:
        """The builds this run made and the ops found in the cache, for its results (build_seconds:
        DeepSpeed's build and load in its process; started_at: seconds after the first start)."""
        builds = [{"op": op, "loaded": bool(r.get("loaded")), "built_now": bool(r.get("built_now")),
                   "build_seconds": round(float(r.get("build_seconds") or 0.0), 2),
                   "wall_seconds": round(float(r["wall_seconds"]), 2),
                   "jobs": r["jobs"], "nice": r["nice"], "started_at": round(r["started_at"], 2)}
                  for op in self.order
                  if (r := getattr(self.builds.get(op), "result", None)) is not None]
        return {"order": list(self.order), "cores": self.cores,
                "cached": [op for op in self.cached if op not in self.order],
                "builds": builds,
                "build_seconds": {b["op"]: b["build_seconds"] for b in builds}}

    @staticmethod
    def _kill(b: Build) -> None:
        if b.proc.poll() is None:
            try:
                os.killpg(b.proc.pid, signal.SIGKILL)  # the build and its compiler jobs
            except (ProcessLookupError, PermissionError):
                b.proc.kill()
        b.proc.wait()

    def close(self) -> None:
        """Stop builds still running (the run ended or was interrupted). A killed build leaves
        its lock behind; the next run removes it (dsconform.base.buildlock)."""
        with self.lock:
            self.closed = True
            builds = list(self.builds.values())
        for b in builds:
            if b.result is None:
                self._kill(b)
                b.follower.join(timeout=10)


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
