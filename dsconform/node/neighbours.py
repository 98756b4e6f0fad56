"""Noisy neighbours: another process computing on a GPU the run measures.

A second process running matmuls on the same GPU halved the suite's matmul on 1xH200 while
holding 1 GiB, under the "GPU busy at start" memory rule (docs/findings.md#matmul). So the run
reads NVML's running compute processes at its start (dsconform.node.detect.probe, with each
GPU's idle utilization) and polls them while it runs (``NeighbourWatch``); any process that is
not this run's own (the pytest process that started the run and everything below it: rank
pools, op checks, xdist workers) is a neighbour, named by pid and process name.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dsconform.node.detect import GpuProcess, compute_processes, nvml_devices

#: An idle GPU shows 0%; a few percent is the driver's own work.
IDLE_UTILIZATION_PCT = 10
POLL_S = 1.0


def run_root(pid: int | None = None) -> int:
    """The process that started this run: the topmost pytest ancestor (an xdist worker's
    controller), else this process."""
    import psutil
    proc = psutil.Process(pid or os.getpid())
    root = proc
    try:
        for parent in proc.parents():
            if any("pytest" in part for part in parent.cmdline()):
                root = parent
    except psutil.Error:
        pass
    return root.pid


def own_pids(root: int) -> set[int]:
    """The run's processes: ``root`` and everything below it."""
    import psutil
    try:
        top = psutil.Process(root)
        return {root, *(p.pid for p in top.children(recursive=True))}
    except psutil.Error:
        return {root}


def neighbours(processes: Iterable[GpuProcess], ours: set[int]) -> list[GpuProcess]:
    return [p for p in processes if p.pid not in ours]


def busy_at_start(utilization: list[int | None],
                  limit: int = IDLE_UTILIZATION_PCT) -> list[tuple[int, int]]:
    """(NVML index, %) of each GPU busier than ``limit`` before the run touched it."""
    return [(i, u) for i, u in enumerate(utilization) if u is not None and u > limit]


@dataclass(frozen=True)
class Sighting:
    """A neighbour seen while the run ran: when (seconds after the watch started) and who."""

    after_s: float
    process: GpuProcess

    def describe(self, bus_ids: list[str] | None = None) -> str:
        where = f"GPU {self.process.gpu}"
        if bus_ids and self.process.gpu < len(bus_ids):
            where += f" ({bus_ids[self.process.gpu]})"
        return f"{where}: {self.process.describe()}, first seen {self.after_s:.0f} s into the run"


class NeighbourWatch:
    """Polls NVML's compute processes every ``poll_s`` from start() to stop(); keeps the first
    sighting of every process that is not the run's own. ``read`` is the poll (injectable:
    the project's tests give it a fake); ``why`` says why nothing could be read."""

    def __init__(self, read: Callable[[], list[GpuProcess]], ours: Callable[[], set[int]],
                 poll_s: float = POLL_S) -> None:
        self._read, self._ours, self.poll_s = read, ours, poll_s
        self.sightings: dict[tuple[int, int], Sighting] = {}
        self.polls = 0
        self.why = ""
        self._known: set[int] = set()  # pids once seen as the run's own stay its own
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._close: Callable[[], Any] | None = None  # releases what ``read`` opened

    @classmethod
    def on_this_node(cls, poll_s: float = POLL_S) -> NeighbourWatch:
        """A watch of this node's GPUs through NVML, the run's own processes below run_root()."""
        root = run_root()
        stack: list[Any] = []

        def read() -> list[GpuProcess]:
            if not stack:
                ctx = nvml_devices()
                stack.append((ctx, ctx.__enter__()))
            nvml, handles = stack[0][1]
            return compute_processes(nvml, handles)

        watch = cls(read, lambda: own_pids(root), poll_s)
        watch._close = lambda: stack and stack[0][0].__exit__(None, None, None)
        return watch

    def poll(self) -> None:
        self._known |= self._ours()
        try:
            procs = self._read()
        except Exception as e:  # NVML gone: say so once, the test reports it
            self.why = self.why or f"NVML could not be read: {e}"
            return
        self._known |= self._ours()  # a rank that started while NVML was read is ours too
        self.polls += 1
        for proc in neighbours(procs, self._known):
            self.sightings.setdefault((proc.gpu, proc.pid),
                                      Sighting(time.monotonic() - self._t0, proc))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_s)

    def start(self) -> NeighbourWatch:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dsconform-neighbours",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._close is not None:
            try:
                self._close()
            except Exception:
                pass

    def found(self) -> list[Sighting]:
        self.poll()  # one last look: a neighbour that started a moment ago
        return sorted(self.sightings.values(), key=lambda s: s.after_s)
