"""The hardware error gate: each GPU's error state, read from NVML and the kernel log before a
run and after it, judged by one severity table (dsconform/node/severity.py).

Read per GPU (nvidia-ml-py: no CUDA context, no torch):

- XIDs: an NVML event set (``nvmlEventTypeXidCriticalError``) registered when the run starts and
  read when it ends, and the kernel log's ``NVRM: Xid`` lines since boot (``dmesg``, readable as
  root), each with its time; NVSwitch ``SXid`` lines too;
- uncorrected ECC errors, volatile (since the driver loaded) and aggregate (the GPU's lifetime),
  and the increase of corrected ones during the run;
- remapped rows (corrected, uncorrected, pending, failed) and retired pages pending;
- per active NVLink the replay, recovery and CRC counters; the PCIe replay counter and link width;
- the GPU recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``), persistence and ECC mode.

A counter the GPU does not support (NVML_ERROR_NOT_SUPPORTED) is listed once, as "not supported
on this GPU". Any other error reading a counter means the GPU could not be checked, which fails
the gate: a counter that was not read is never a pass.

NVML is reached through an object with pynvml's functions and constants, passed in (``open_nvml``
yields it with the GPUs' handles), so tests hand in a fake. Snapshots are plain dataclasses
(dsconform/node/readings.py): ``dataclasses.asdict`` is their JSON.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from dsconform.node.detect import nvml_devices, probe_gpu_hardware
from dsconform.node.gpu_health import canonical_bus_id, nvml_bus_id
from dsconform.node.readings import GpuSnapshot, KernelXid, NvLink, RemappedRows, XidEvent
from dsconform.node.severity import Report, Thresholds, judge

# nvmlReturn_t codes (nvml.h)
_NOT_SUPPORTED = {3, 13}  # NOT_SUPPORTED; FUNCTION_NOT_FOUND (a driver older than the call)
_TIMEOUT, _GPU_IS_LOST, _RESET_REQUIRED = 10, 15, 16


class _Reader:
    """Calls NVML for one GPU and sorts every failure into the snapshot."""

    def __init__(self, snap: GpuSnapshot):
        self.snap = snap

    def note(self, counter: str, code: Any, text: str) -> None:
        s = self.snap
        if code in _NOT_SUPPORTED:
            if counter not in s.not_supported:
                s.not_supported.append(counter)
        elif code == _GPU_IS_LOST:
            s.lost = text
        elif code == _RESET_REQUIRED:
            s.reset_required = True
        else:
            s.unreadable[counter] = text

    def __call__(self, counter: str, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as e:  # NVMLError and its subclasses, or a binding without the call
            self.note(counter, getattr(e, "value", None), f"{type(e).__name__}: {e}")
            return None


def _field_value(fv: Any) -> int:
    kind = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[int(fv.valueType)]
    return int(getattr(fv.value, kind))


def read_gpu(nvml: Any, index: int, handle: Any) -> GpuSnapshot:
    """One GPU's counters. Never raises: what cannot be read is sorted into the snapshot."""
    s = GpuSnapshot(index=index, read_at=time.time())
    r = _Reader(s)
    s.bus_id = r("PCI bus id", lambda: nvml_bus_id(nvml, handle))
    name = r("name", lambda: nvml.nvmlDeviceGetName(handle))
    s.name = name.decode() if isinstance(name, bytes) else name
    if s.lost:
        return s
    persistence = r("persistence mode", lambda: nvml.nvmlDeviceGetPersistenceMode(handle))
    s.persistence = None if persistence is None else bool(persistence)
    ecc = r("ECC mode", lambda: nvml.nvmlDeviceGetEccMode(handle))
    s.ecc_enabled = None if ecc is None else bool(ecc[0])
    for attr, kind, counter in (
            ("uncorrected_volatile", "UNCORRECTED", "VOLATILE"),
            ("uncorrected_aggregate", "UNCORRECTED", "AGGREGATE"),
            ("corrected_volatile", "CORRECTED", "VOLATILE"),
            ("corrected_aggregate", "CORRECTED", "AGGREGATE")):
        value = r(f"ECC errors ({attr.replace('_', ' ')})", lambda k=kind, c=counter: (
            nvml.nvmlDeviceGetTotalEccErrors(handle, getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{k}"),
                                             getattr(nvml, f"NVML_{c}_ECC"))))
        setattr(s, attr, None if value is None else int(value))
    rows = r("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None:
        s.remapped_rows = RemappedRows(int(rows[0]), int(rows[1]), bool(rows[2]), bool(rows[3]))
    pending = r("retired pages pending",
                lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    s.retired_pages_pending = None if pending is None else bool(pending)
    s.pcie_replays = r("PCIe replay counter", lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle))
    s.pcie_width = r("PCIe link width", lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
    s.pcie_max_width = r("PCIe link width", lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    s.nvlinks = _read_nvlinks(nvml, handle, r)
    values = r("GPU recovery action", lambda: nvml.nvmlDeviceGetFieldValues(
        handle, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]))
    if values is not None:
        if int(values[0].nvmlReturn) == 0:
            s.recovery_action = _field_value(values[0])
        else:
            r.note("GPU recovery action", int(values[0].nvmlReturn),
                   f"nvmlDeviceGetFieldValues returned {int(values[0].nvmlReturn)}")
    procs = r("running compute processes",
              lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    s.compute_processes = None if procs is None else len(procs)
    return s


def _read_nvlinks(nvml: Any, handle: Any, r: _Reader) -> list[NvLink]:
    """Every link NVML knows: link 0 decides whether the GPU has NVLink at all; the first link
    that answers with an error past it is past the GPU's last link."""
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        if link == 0:
            active = r("NVLink", lambda: nvml.nvmlDeviceGetNvLinkState(handle, 0))
            if active is None:
                return []
        else:
            try:
                active = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except Exception:
                break
        lk = NvLink(link, bool(active))
        if lk.active:
            for attr, const in (("replay", "REPLAY"), ("recovery", "RECOVERY"),
                                ("crc_flit", "CRC_FLIT"), ("crc_data", "CRC_DATA")):
                setattr(lk, attr, r("NVLink error counters", lambda c=const, n=link: (
                    nvml.nvmlDeviceGetNvLinkErrorCounter(
                        handle, n, getattr(nvml, f"NVML_NVLINK_ERROR_DL_{c}")))))
        links.append(lk)
    return links


def read_gpus(nvml: Any, handles: Sequence[Any]) -> list[GpuSnapshot]:
    return [read_gpu(nvml, i, h) for i, h in enumerate(handles)]


# ------------------------------------------------------------------ XIDs

class XidWatch:
    """An NVML event set for XID critical errors, from ``start`` to ``collect``. It holds an
    nvmlInit reference of its own, so the set and its handles outlive the reads around it."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.event_set: Any = None
        self.not_supported: list[int] = []  # GPU indexes that cannot register the event
        self.errors: list[str] = []
        self.started_at = time.time()
        self._open = False

    @classmethod
    def start(cls, nvml: Any, handles: Sequence[Any]) -> XidWatch:
        w = cls(nvml)
        try:
            nvml.nvmlInit()
            w._open = True
            w.event_set = nvml.nvmlEventSetCreate()
        except Exception as e:
            w.errors.append(f"XID event set: {type(e).__name__}: {e}")
            w.close()
            return w
        for i, h in enumerate(handles):
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, w.event_set)
            except Exception as e:
                if getattr(e, "value", None) in _NOT_SUPPORTED:
                    w.not_supported.append(i)
                else:
                    w.errors.append(f"GPU {i}: XID events: {type(e).__name__}: {e}")
        return w

    def collect(self, limit: int = 10_000) -> list[XidEvent]:
        """Every event since ``start`` (waits for none), then closes the set."""
        events: list[XidEvent] = []
        while self.event_set is not None and len(events) < limit:
            try:
                data = self.nvml.nvmlEventSetWait(self.event_set, 0)
            except Exception as e:
                if getattr(e, "value", None) != _TIMEOUT:
                    self.errors.append(f"XID events: {type(e).__name__}: {e}")
                break
            try:
                bus = nvml_bus_id(self.nvml, data.device)
            except Exception:
                bus = None
            events.append(XidEvent(bus, int(data.eventData), time.time()))
        self.close()
        return events

    def close(self) -> None:
        if self.event_set is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(self.event_set)
            self.event_set = None
        if self._open:
            self._open = False
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


_XID_LINE = re.compile(r"(?:^\[\s*(?P<ts>\d+\.\d+)\]\s*)?.*?\b(?P<kind>S?Xid)\s+\((?:PCI:)?"
                       r"(?P<bus>[0-9A-Fa-f:.]+)\):\s*(?P<code>\d+)\s*,?\s*(?P<rest>.*)$")


def parse_kernel_log(text: str, boot_at: float) -> list[KernelXid]:
    """The Xid and SXid lines of ``dmesg`` output; ``boot_at``: the epoch second of boot."""
    out = []
    for line in text.splitlines():
        m = _XID_LINE.search(line)
        if not m or "Xid" not in line.split("]", 1)[-1]:
            continue
        ts = float(m.group("ts")) if m.group("ts") else None
        out.append(KernelXid(m.group("kind"), int(m.group("code")),
                             canonical_bus_id(m.group("bus")), ts,
                             None if ts is None else boot_at + ts, m.group("rest").strip()[:200]))
    return out


def read_kernel_log(timeout: float = 10.0) -> tuple[str | None, str]:
    """(dmesg's text, "") or (None, why it could not be read)."""
    if not shutil.which("dmesg"):
        return None, "dmesg not found"
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"dmesg: {e}"
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[0]
        return None, f"dmesg: {why} (the kernel log is readable as root)"
    return out.stdout, ""


def boot_time() -> float:
    """The epoch second dmesg's timestamps count from (CLOCK_MONOTONIC's zero)."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)




# ------------------------------------------------------------------ the gate

#: Of one GPU's findings of one kind (NVLink CRC errors on each of its 18 links), the most a
#: summary note spells out.
DETAILS_SHOWN = 3


def monitor_notes(report: Report, when: str) -> list[str]:
    """The run summary's notes of MONITOR findings: one line per GPU and condition, however
    many links or counters of that GPU show it."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in report.monitor:
        groups.setdefault((f.where, f.what), []).append(f.detail)
    out = []
    for (where, what), details in groups.items():
        shown = "; ".join(details[:DETAILS_SHOWN])
        if len(details) > DETAILS_SHOWN:
            shown += f"; and {len(details) - DETAILS_SHOWN} more"
        count = f"{len(details)} x " if len(details) > 1 else ""
        out.append(f"hardware MONITOR at the {when} of the run: {where}: {what}: {count}{shown}")
    return out


def _could_not_check(gpus: Sequence[GpuSnapshot]) -> list[str]:
    return [f"{s.label}: {counter}: {why}" for s in gpus for counter, why in s.unreadable.items()]


KernelLog = Callable[[], tuple[str | None, str]]


class Gate:
    """The gate of one run: ``begin`` reads every GPU and registers the XID event set, ``end``
    reads them again and judges what happened in between. ``open_nvml`` (a context manager
    yielding the nvml module and the GPUs' handles) and ``kernel_log`` are the sources."""

    def __init__(self, thresholds: Thresholds | None = None, *,
                 open_nvml: Callable[[], Any] = nvml_devices,
                 kernel_log: KernelLog = read_kernel_log, boot_at: float | None = None):
        self.thresholds = thresholds or Thresholds()
        self._open = open_nvml
        self._kernel_log = kernel_log
        self._boot_at = boot_at
        self.before: list[GpuSnapshot] | None = None
        self.started_at: float | None = None
        self.watch: XidWatch | None = None
        self._start_keys: set[str] = set()

    def _kernel(self, report: Report, without: str) -> list[KernelXid]:
        text, why = self._kernel_log()
        if text is None:
            report.notes.append(f"kernel log not read ({why}): {without}")
            return []
        report.kernel = parse_kernel_log(text, boot_time() if self._boot_at is None
                                         else self._boot_at)
        report.notes.append(f"kernel log: {sum(k.kind == 'Xid' for k in report.kernel)} Xid, "
                            f"{sum(k.kind == 'SXid' for k in report.kernel)} SXid lines since "
                            "boot")
        return report.kernel

    def _read(self, report: Report, watch: bool) -> list[GpuSnapshot] | None:
        try:
            with self._open() as (nvml, handles):
                gpus = read_gpus(nvml, handles)
                if watch:
                    self.watch = XidWatch.start(nvml, handles)
                    for i in self.watch.not_supported:
                        gpus[i].not_supported.append("XID events")
                    report.could_not_check += self.watch.errors
                elif self.watch is not None:
                    report.events = self.watch.collect()
                    report.could_not_check += self.watch.errors
        except Exception as e:  # no NVML library, no driver, NVML refusing
            report.could_not_check.append(f"NVML cannot be read: {type(e).__name__}: {e}")
            return None
        report.gpus = gpus
        report.could_not_check += _could_not_check(gpus) if gpus else ["NVML lists no GPU"]
        return gpus

    def state(self) -> Report:
        """The node as it is now, with the kernel log since boot: ``dsconform health``."""
        t0, report = time.perf_counter(), Report()
        gpus = self._read(report, watch=False)
        if gpus is not None:
            kernel = self._kernel(report, "XIDs since boot are not checked")
            report.findings = judge(gpus, kernel=kernel, thresholds=self.thresholds)
        report.seconds = time.perf_counter() - t0
        return report

    def begin(self, since: float | None = None) -> Report:
        """The run's start (``since``, default now: kernel log lines after it are the run's):
        each GPU's state and the XIDs so far; the XID event set opens."""
        t0, report = time.perf_counter(), Report()
        self.started_at = time.time() if since is None else since
        gpus = self._read(report, watch=True)
        if gpus is not None:
            kernel = self._kernel(report, "XIDs come from the NVML event set only")
            report.findings = judge(gpus, kernel=kernel, since=self.started_at,
                                    thresholds=self.thresholds)
            self.before = gpus
            self._start_keys = {f.key for f in report.findings}
        report.seconds = time.perf_counter() - t0
        return report

    def end(self, since: float | None = None) -> Report:
        """The run's end: what is new since ``begin`` (found at the start: not repeated). Without
        a ``begin`` in this process, the state now and the XIDs since ``since`` (the run's
        start)."""
        t0, report = time.perf_counter(), Report()
        since = self.started_at if self.started_at is not None else since
        if self.before is None:
            report.notes.append("no reading from the start of the run in this process (HEALTH-1 "
                                "deselected, or run by another xdist worker): increases during "
                                "the run are not judged, only the state now and the XIDs")
        gpus = self._read(report, watch=False)
        if gpus is not None:
            kernel = self._kernel(report, "XIDs come from the NVML event set only")
            found = judge(gpus, before=self.before, events=report.events, kernel=kernel,
                          since=since, thresholds=self.thresholds)
            report.findings = [f for f in found if f.key not in self._start_keys]
        report.seconds = time.perf_counter() - t0
        return report

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def check(thresholds: Thresholds | None = None, *, open_nvml: Callable[[], Any] = nvml_devices,
          kernel_log: KernelLog = read_kernel_log,
          hardware: Callable[[], Any] | None = None) -> Report:
    """``dsconform health``: the node's state now. A machine without NVIDIA GPUs is "could not
    check" with that reason (``hardware``: the GPUs on the PCI bus, counted without NVML)."""
    report = Gate(thresholds, open_nvml=open_nvml, kernel_log=kernel_log).state()
    if report.gpus:
        return report
    hw = (hardware or (lambda: probe_gpu_hardware(nvml=False)))()
    if not hw.count:
        report.could_not_check[:] = [f"no NVIDIA GPU on this machine: nothing to read "
                                     f"({report.could_not_check[0]}; none on the PCI bus or in "
                                     "/proc/driver/nvidia)"]
    else:
        report.could_not_check[0] += (f" ({hw.count} NVIDIA GPUs on the PCI bus: check the "
                                      "driver and dmesg)")
    return report


def command(*, as_json: bool, thresholds: Thresholds | None = None, out: TextIO | None = None,
            **sources: Any) -> int:
    """Print the report (one line per GPU, or JSON) and return the exit code."""
    report = check(thresholds, **sources)
    out = out or sys.stdout
    if as_json:
        json.dump(report.to_dict(), out, indent=2, default=str)
        out.write("\n")
    else:
        for line in report.lines():
            out.write(line + "\n")
    return report.exit_code
