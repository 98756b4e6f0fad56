"""The burn-in (``--soak MINUTES``, suites/test_sdc.py SOAK-1): its judgement, its per-GPU
report, its progress line. Pure functions over what the ranks and the gate's sampler report, so
the project's tests drive them with any iteration, reading or timing.

What a rank reports (suites/sdc_ranks.py ``soak``)::

    {"identity": {...}, "serial": "1654922001234", "name": "NVIDIA H200",
     "iterations": [{"iteration": 0, "elapsed_s": 41.2, "tflops": 689.0,
                     "mismatches": 0, "problems": []}, ...]}

``mismatches`` counts what one iteration found wrong (a known-answer hash other than the
GPU's first iteration's, bits other than rank 0's, a value off the float64 reference, a
ZeRO step off DDP's, an HBM word read back wrong); ``problems`` says the first of them.

What the sampler reads of each GPU at each tick (dsconform/node/sampler.py)::

    {"at": 12.0, "gpu": 0, "bus_id": "0000:1b:00.0", "temperature_c": 61,
     "slowdown_c": 87, "clock_events": 0}

Throughput drift: the median sustained-matmul rate of the first window of iterations against
the last window's (each a quarter of the iterations, at least one); a GPU whose rate fell by
more than ``straggler_pct`` percent fails, the threshold the suite holds a GPU to against its
peers (dsconform/node/gpu_health.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dsconform.results.format import SOAK_SECTION

#: The fact the soak's summary is recorded under (benchmarks.json), and summary.json's key.
FACT = SOAK_SECTION
#: Problems shown per GPU; the rest are counted.
SHOWN = 4
#: NVML's names of the slowdown bits (nvml.h nvmlClocksEventReason*), for the report.
SLOWDOWN_NAMES = {0x8: "HW_SLOWDOWN", 0x20: "SW_THERMAL_SLOWDOWN", 0x40: "HW_THERMAL_SLOWDOWN",
                  0x80: "HW_POWER_BRAKE_SLOWDOWN"}


def window_size(n: int) -> int:
    """Iterations in each of the first and last windows: a quarter of ``n``, at least one."""
    return max(1, n // 4)


def window_drift(rates: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """(the first window's median rate, the last window's, how many percent the last is below
    the first); Nones with fewer than two rates (one window is no drift)."""
    rates = [float(r) for r in rates if r is not None]
    if len(rates) < 2:
        return None, None, None
    w = window_size(len(rates))
    first, last = statistics.median(rates[:w]), statistics.median(rates[-w:])
    drift = 100.0 * (first - last) / first if first > 0 else None
    return first, last, drift


@dataclass
class GpuSoak:
    """One GPU's burn-in."""
    label: str                 # GPU 1 (PCI 0000:2a:00.0, rank 1), serial ...
    gpu: int | None            # NVML index
    bus_id: str | None
    iterations: int = 0
    mismatches: int = 0
    problems: list[str] = field(default_factory=list)
    tflops_first: float | None = None
    tflops_last: float | None = None
    drift_pct: float | None = None
    samples: int = 0
    max_temperature_c: float | None = None
    slowdown_temperature_c: float | None = None
    throttle: dict[str, int] = field(default_factory=dict)   # NVML name -> samples showing it
    findings: list[str] = field(default_factory=list)        # the gate's, on this GPU

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_reports(results: Sequence[Mapping[str, Any]], ids: Sequence[Any],
                samples: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[GpuSoak]:
    """Each GPU's iterations, mismatches, drift, and what the sampler read of it (matched by
    PCI bus id, else by NVML index)."""
    out = []
    for res, ident, label in zip(results, ids, labels):
        its = list(res.get("iterations") or [])
        first, last, drift = window_drift([it.get("tflops") for it in its])
        g = GpuSoak(label=label, gpu=ident.gpu, bus_id=ident.bus_id, iterations=len(its),
                    mismatches=sum(int(it.get("mismatches") or 0) for it in its),
                    tflops_first=first, tflops_last=last, drift_pct=drift)
        for it in its:
            g.problems += [f"iteration {it.get('iteration')}: {p}" for p in it.get("problems")
                           or []][:SHOWN - len(g.problems)]
        mine = [s for s in samples if (ident.bus_id and s.get("bus_id") == ident.bus_id)
                or (not ident.bus_id and ident.gpu is not None and s.get("gpu") == ident.gpu)]
        g.samples = len(mine)
        temps = [s["temperature_c"] for s in mine if s.get("temperature_c") is not None]
        g.max_temperature_c = max(temps) if temps else None
        limits = [s["slowdown_c"] for s in mine if s.get("slowdown_c")]
        g.slowdown_temperature_c = min(limits) if limits else None
        for s in mine:
            for bit, name in SLOWDOWN_NAMES.items():
                if int(s.get("clock_events") or 0) & bit:
                    g.throttle[name] = g.throttle.get(name, 0) + 1
        out.append(g)
    return out


def attach_findings(reports: Sequence[GpuSoak], findings: Sequence[tuple[str | None, str]]
                    ) -> list[str]:
    """Give each gate finding (``(bus id or None, line)``) to its GPU's report; returns those
    of no GPU of the soak (the node's: an SXid, an XID on another GPU)."""
    rest = []
    for bus, line in findings:
        mine = next((r for r in reports if bus and r.bus_id == bus), None)
        if mine is None:
            rest.append(line)
        else:
            mine.findings.append(line)
    return rest


def verdict(reports: Sequence[GpuSoak], straggler_pct: float,
            node_findings: Sequence[str] = (), could_not_sample: Sequence[str] = ()
            ) -> list[str]:
    """SOAK-1: one line per reason the burn-in fails, each naming its GPU: a mismatch, a gate
    finding, a slowdown clock event, a temperature at the GPU's own slowdown threshold, a
    throughput drift past ``straggler_pct``, a GPU that ran no iteration or was never read;
    then the node's findings and why the gate could not be sampled."""
    out = []
    for g in reports:
        if not g.iterations:
            out.append(f"{g.label}: ran no iteration of the soak")
        if g.mismatches:
            out.append(f"{g.label}: {g.mismatches} mismatches in {g.iterations} iterations: "
                       + "; ".join(g.problems))
        out += [f"{g.label}: {line}" for line in g.findings]
        for name, n in g.throttle.items():
            out.append(f"{g.label}: clock event {name} in {n} of {g.samples} readings "
                       f"(a slowdown for a fault of the GPU or its cooling)")
        if g.max_temperature_c is not None and g.slowdown_temperature_c is not None \
                and g.max_temperature_c >= g.slowdown_temperature_c:
            out.append(f"{g.label}: reached {g.max_temperature_c:g} C, at or above its slowdown "
                       f"temperature {g.slowdown_temperature_c:g} C (NVML)")
        if g.drift_pct is not None and g.drift_pct > straggler_pct:
            w = window_size(g.iterations)
            out.append(f"{g.label}: sustained matmul fell {g.drift_pct:.1f}% from "
                       f"{g.tflops_first:.1f} TFLOPS (median of the first {w} iterations) to "
                       f"{g.tflops_last:.1f} (the last {w}), past straggler_pct "
                       f"{straggler_pct:g}%")
        if g.iterations and not g.samples:
            out.append(f"{g.label}: the hardware gate never read this GPU during the soak")
    out += [f"node: {line}" for line in node_findings]
    out += [f"the hardware gate could not be sampled: {why}" for why in could_not_sample]
    return out


def progress_line(elapsed_s: float, total_s: float,
                  per_gpu: Sequence[tuple[str, int, int, float | None]]) -> str:
    """The console's line once a minute: ``soak 12/60 min: GPU 0 214 it 0 mism 61 C, ...``
    (``per_gpu``: (GPU name, iterations, mismatches, temperature now or None))."""
    gpus = ", ".join(f"{name} {it} it {mism} mism "
                     + (f"{temp:g} C" if temp is not None else "? C")
                     for name, it, mism, temp in per_gpu)
    return f"soak {elapsed_s / 60:.0f}/{total_s / 60:.0f} min: {gpus or 'no GPU reported yet'}"


def summary(minutes: float, elapsed_s: float, interval_s: float, straggler_pct: float,
            reports: Sequence[GpuSoak], problems: Sequence[str],
            catalogue: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """summary.json's ``soak`` section (docs/results-format.md). ``catalogue``: the known
    answers iteration 0 was compared with (``file``, its ``sha256``, the GPUs ``compared`` and
    those ``not_compared`` with the reason)."""
    return {"minutes": minutes, "elapsed_s": round(elapsed_s, 1), "sample_interval_s": interval_s,
            "straggler_pct": straggler_pct, "passed": not problems, "problems": list(problems),
            "catalogue": dict(catalogue or {}), "gpus": [g.to_dict() for g in reports]}
