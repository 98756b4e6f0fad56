"""The hardware gate sampled throughout a burn-in (``--soak``): a thread that reads every GPU
through the gate's own readers (dsconform/node/health.py ``Gate`` and ``read_gpus``) every
``interval_s`` seconds, and judges each reading against the soak's first (dsconform/node/
severity.py ``judge``), so an ECC error, a row remap, a PCIe or NVLink error or an XID is named
with the minute it appeared. Each tick also reads what the gate reads only once per run: the
temperature, the GPU's own slowdown temperature (NVML's threshold) and the clock event
reasons.

``open_nvml`` and ``kernel_log`` are the gate's sources: the project's tests pass fakes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsconform.node.detect import nvml_devices
from dsconform.node.gpu_health import clock_event_reader
from dsconform.node.health import Gate, KernelLog, read_gpus, read_kernel_log
from dsconform.node.severity import Thresholds, judge

#: NVML_TEMPERATURE_GPU and NVML_TEMPERATURE_THRESHOLD_SLOWDOWN (nvml.h).
_TEMPERATURE_GPU = 0
_THRESHOLD_SLOWDOWN = 1


@dataclass
class Sampled:
    """What the sampler saw: the readings (checks/soak.py's sample shape), the failing findings
    as ``(bus id or None, line)`` each once with the soak's second it appeared, and why a tick
    could not read."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    findings: list[tuple[str | None, str]] = field(default_factory=list)
    could_not: list[str] = field(default_factory=list)


class GateSampler:
    """``start()`` opens the gate (its first reading and the XID event set), a thread reads every
    ``interval_s``; ``stop()`` ends it and judges the whole soak once more (``Gate.end``: the
    XIDs the event set and the kernel log saw)."""

    def __init__(self, thresholds: Thresholds | None = None, interval_s: float = 10.0, *,
                 open_nvml: Callable[[], Any] = nvml_devices,
                 kernel_log: KernelLog = read_kernel_log, clock: Callable[[], float] = time.time):
        self.interval_s = interval_s
        self.gate = Gate(thresholds, open_nvml=open_nvml, kernel_log=kernel_log)
        self._open = open_nvml
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._thread: threading.Thread | None = None
        self.started_at = 0.0
        self.result = Sampled()

    def start(self) -> GateSampler:
        self.started_at = self._clock()
        report = self.gate.begin(since=self.started_at)
        self._seen = {f.key for f in report.findings}  # the state before the soak: HEALTH-1's
        self.result.could_not += report.could_not_check
        self.tick()
        self._thread = threading.Thread(target=self._run, name="dsconform-soak-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """One reading of every GPU, judged against the soak's first."""
        at = round(self._clock() - self.started_at, 1)
        try:
            with self._open() as (nvml, handles):
                gpus = read_gpus(nvml, handles)
                reasons = clock_event_reader(nvml)
                rows = []
                for snap, h in zip(gpus, handles):
                    rows.append({"at": at, "gpu": snap.index, "bus_id": snap.bus_id,
                                 "temperature_c": _read(nvml.nvmlDeviceGetTemperature, h,
                                                        _TEMPERATURE_GPU),
                                 "slowdown_c": _read(nvml.nvmlDeviceGetTemperatureThreshold, h,
                                                     _THRESHOLD_SLOWDOWN),
                                 "clock_events": _read(reasons, h)})
        except Exception as e:  # NVML gone mid-soak: said, and the soak fails on it
            with self._lock:
                self.result.could_not.append(f"at {at:g} s: NVML cannot be read: "
                                             f"{type(e).__name__}: {e}")
            return
        found = judge(gpus, before=self.gate.before, thresholds=self.gate.thresholds)
        with self._lock:
            self.result.samples += rows
            self._add(found, at)

    def _add(self, found: list, at: float | None) -> None:
        for f in found:
            if f.action.fails and f.key not in self._seen:
                self._seen.add(f.key)
                when = f"at {at:g} s of the soak: " if at is not None else ""
                self.result.findings.append((f.bus_id, when + f.line))

    def latest(self) -> dict[str | None, dict[str, Any]]:
        """The last reading of each GPU, by bus id (the progress line's temperatures)."""
        with self._lock:
            return {s["bus_id"]: s for s in self.result.samples}

    def stop(self) -> Sampled:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(30.0, 3 * self.interval_s))
        report = self.gate.end()
        with self._lock:
            self.result.could_not += report.could_not_check
            self._add(report.findings, None)
        self.gate.close()
        return self.result


def _read(call: Callable[..., Any], *args: Any) -> int | None:
    """One NVML value; None where the GPU does not give it (NOT_SUPPORTED)."""
    try:
        return int(call(*args))
    except Exception:
        return None
