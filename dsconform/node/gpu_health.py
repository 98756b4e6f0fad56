"""Per-GPU health: which physical GPU a rank runs on, and when one GPU, link or rank is a
straggler among its peers.

Identity. A rank knows its device as torch's index, which depends on CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER (FASTEST_FIRST by default, so torch's cuda:0 need not be nvidia-smi's GPU 0).
The PCI bus id is what does not move: ranks report it from
``torch.cuda.get_device_properties(i).pci_domain_id/pci_bus_id/pci_device_id`` and the parent maps
it to the NVML index (nvidia-smi's numbering) through the bus ids the node probe read from NVML
(``NodeFacts.hardware.bus_ids``). Failures name both: ``GPU 1 (PCI 0000:2a:00.0)``.

Stragglers. A value is compared with the median of the *other* GPUs' (or links') values, so on a
2-GPU node a GPU is compared with its one peer, not with a median it pulls down itself. A GPU,
link or rank is a straggler when it is more than ``straggler_pct`` percent slower than that
median: its rate below (100 - pct)% of it, or, in a collective, the other ranks waiting for it
more than pct% of the collective's time (where a call takes at least MIN_WAIT_CHECK_SECONDS).
The threshold comes from the profile (``[gpus] straggler_pct``), else DEFAULT_STRAGGLER_PCT.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_STRAGGLER_PCT", "MIN_WAIT_CHECK_SECONDS", "MIN_WAIT_SECONDS", "SLOWDOWN_REASONS",
    "GpuIdentity",
    "canonical_bus_id", "identify", "matmul_flops", "pct_of_peer_median",
    "read_clock_event_reasons", "slowdown_problems", "slowdowns_under_load", "straggler_pct",
    "unread_clock_events", "waited_for_pct",
]

#: Used when the profile does not set ``[gpus] straggler_pct``: loose enough that a healthy node
#: never trips it (GPUs of one node agree within a few percent), tight enough to name a GPU that
#: runs at a fraction of its peers' speed.
DEFAULT_STRAGGLER_PCT = 20.0
#: Waits are held to the threshold only where a call takes at least this long. Below it (a
#: 1 MiB all_reduce over NVLink takes ~40 us, host-bound in torch.distributed) a few
#: microseconds of launch jitter are a large share of the call and say nothing about a GPU; the
#: per-rank times are recorded all the same.
MIN_WAIT_CHECK_SECONDS = 1e-4
#: ... and only where the median round's wait itself is at least this long: a host-bound call
#: near MIN_WAIT_CHECK_SECONDS (a 1 MiB all_reduce on 2xH200 took 60-103 us) carries 10-13 us
#: of launch skew on healthy GPUs, 12% of such a call (docs/findings.md#collectives); a GPU
#: that holds its peers up costs them far more at the sizes that carry floors.
MIN_WAIT_SECONDS = 5e-5

_BUS_RE = re.compile(r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
                     r"(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?$")


#: NVML's clock event ("throttle") reasons that mean the GPU is slowed by something wrong with
#: it or its surroundings (nvml.h nvmlClocksEventReason*), by bit. Idle, application clocks,
#: the software power cap (a configured limit), sync boost and display clocks are not faults.
SLOWDOWN_REASONS = {
    0x8: "hardware slowdown (HW_SLOWDOWN: thermal or power-brake signal, or a failing supply)",
    0x20: "software thermal slowdown (SW_THERMAL_SLOWDOWN: above the max operating temperature)",
    0x40: "hardware thermal slowdown (HW_THERMAL_SLOWDOWN: the GPU is too hot)",
    0x80: "hardware power-brake slowdown (HW_POWER_BRAKE_SLOWDOWN: the system asked to brake)",
}


def slowdown_problems(reasons_by_gpu: Sequence[tuple[int, str | None, int]]) -> list[str]:
    """One line per GPU whose clock event reasons (``(nvidia-smi index, bus id, bitmask)``)
    include a slowdown of ``SLOWDOWN_REASONS``."""
    out = []
    for index, bus, mask in reasons_by_gpu:
        found = [why for bit, why in SLOWDOWN_REASONS.items() if mask & bit]
        if found:
            out.append(f"GPU {index} (PCI {bus}): {'; '.join(found)} (reasons mask {mask:#x})")
    return out


def slowdowns_under_load(results: Sequence[Mapping[str, Any]], ids: Sequence[GpuIdentity],
                         what: str) -> list[str]:
    """One line per GPU whose clock event reasons, read while ``what`` ran on it
    (suites/collective_ranks.py ClockEvents: ``clock_events_mask``), include a slowdown."""
    out = []
    for res, ident in zip(results, ids):
        mask = res.get("clock_events_mask")
        if mask:
            out += [f"{line} while {what} ran ({res.get('clock_event_samples')} readings)"
                    for line in slowdown_problems([(ident.gpu, ident.bus_id, int(mask))])]
    return out


def unread_clock_events(results: Sequence[Mapping[str, Any]],
                        ids: Sequence[GpuIdentity]) -> list[str]:
    """One line per GPU whose clock event reasons could not be read under load (NVML missing
    or refusing, no bus id): without them the slowdown check would pass unseen."""
    return [f"{ident.label}: {res.get('clock_events_why') or 'not read'}"
            for res, ident in zip(results, ids)
            if res.get("clock_events_mask") is None or not res.get("clock_event_samples")]


def read_clock_event_reasons() -> list[tuple[int, str | None, int]]:
    """(nvidia-smi index, PCI bus id, clock event reasons bitmask) of every GPU, from NVML;
    raises when NVML is missing or cannot initialise."""
    from dsconform.node.detect import nvml_devices

    with nvml_devices() as (nvml, handles):
        read = clock_event_reader(nvml)
        return [(i, nvml_bus_id(nvml, h), int(read(h))) for i, h in enumerate(handles)]


def clock_event_reader(nvml: Any) -> Any:
    """NVML's "clock event reasons" call (named "throttle reasons" before driver 535)."""
    return (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)


def nvml_bus_id(nvml: Any, handle: Any) -> str | None:
    """One NVML device's PCI address in sysfs form (canonical_bus_id)."""
    from dsconform.node.detect import nvml_text

    return canonical_bus_id(nvml_text(nvml.nvmlDeviceGetPciInfo(handle).busId))


def nvml_handle(stack: Any, bus_id: str | None) -> tuple[Any, Any, str]:
    """(nvml, the handle of the GPU at ``bus_id``, "") with NVML opened on ``stack`` (an
    ExitStack the caller closes), else (None, None, why not): no bus id, no NVML, or no GPU of
    NVML's at that address. For samplers inside a rank, which must say why they read nothing
    rather than fail the rank."""
    from dsconform.node.detect import nvml_devices

    if bus_id is None:
        return None, None, "no PCI bus id for this rank's device"
    try:
        nvml, handles = stack.enter_context(nvml_devices())
    except Exception as e:  # NVML missing: say so, do not fail the rank
        return None, None, f"NVML unavailable: {e}"
    mine = canonical_bus_id(bus_id)
    handle = next((h for h in handles if nvml_bus_id(nvml, h) == mine), None)
    if handle is None:
        return None, None, f"NVML lists no GPU at {bus_id}"
    return nvml, handle, ""


def canonical_bus_id(text: str | None) -> str | None:
    """A PCI address in sysfs form, ``0000:2a:00.0``, from NVML's ``00000000:2A:00.0``, the
    driver's ``0000:2a:00.0``, nccl-tests' ``0000:2a:00`` or a bare ``2a:00.0``; None when
    ``text`` is not one."""
    if not text:
        return None
    m = _BUS_RE.match(text.strip())
    if not m:
        return None
    domain = int(m.group("domain") or "0", 16)
    return (f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}."
            f"{int(m.group('fn') or '0')}")


@dataclass(frozen=True)
class GpuIdentity:
    """What one rank computes on. ``gpu`` is the NVML index (nvidia-smi's), None when the rank
    runs on the CPU or its bus id is not among the node's NVML bus ids."""
    rank: int
    device: str                  # "cuda:1" (the rank's own torch index) or "cpu"
    bus_id: str | None = None    # canonical PCI address
    gpu: int | None = None       # NVML index
    visible: str | None = None   # this GPU's entry in the parent's CUDA_VISIBLE_DEVICES

    @property
    def label(self) -> str:
        if self.device == "cpu":
            return f"rank {self.rank} (cpu)"
        index = f"GPU {self.gpu}" if self.gpu is not None else f"GPU {self.device}"
        pci = f"PCI {self.bus_id}" if self.bus_id else "PCI bus id unknown"
        return f"{index} ({pci}, rank {self.rank})"

    def params(self, prefix: str = "") -> dict[str, Any]:
        """Stable parameters for metric records (the same GPU gets the same ones every run)."""
        return {f"{prefix}rank": self.rank, f"{prefix}gpu": self.gpu,
                f"{prefix}bus_id": self.bus_id, f"{prefix}device": self.device}


def identify(reported: Sequence[Mapping[str, Any]],
             nvml_bus_ids: Sequence[str] = ()) -> list[GpuIdentity]:
    """Map what each rank reported (``rank``, ``device``, ``bus_id``, ``visible``) to the NVML
    index through its PCI bus id."""
    nvml = {canonical_bus_id(b): i for i, b in enumerate(nvml_bus_ids)}
    nvml.pop(None, None)
    out = []
    for info in reported:
        bus = canonical_bus_id(info.get("bus_id"))
        out.append(GpuIdentity(rank=int(info["rank"]), device=str(info["device"]), bus_id=bus,
                               gpu=nvml.get(bus) if bus else None,
                               visible=info.get("visible")))
    return out


def straggler_pct(profile_value: float | None) -> float:
    """The threshold in force: the profile's ``[gpus] straggler_pct``, else the default."""
    return DEFAULT_STRAGGLER_PCT if profile_value is None else float(profile_value)


def pct_of_peer_median(values: Sequence[float]) -> list[float]:
    """Each value as a percentage of the median of the *other* values (higher is better for
    rates). Needs at least two values."""
    if len(values) < 2:
        raise ValueError(f"a comparison with peers needs at least 2 values, got {len(values)}")
    out = []
    for i, v in enumerate(values):
        peers = statistics.median([w for j, w in enumerate(values) if j != i])
        out.append(100.0 * v / peers if peers > 0 else float("inf"))
    return out


def waited_for_pct(inside_seconds: Sequence[float], job_seconds: float) -> list[float]:
    """For each rank: how long the other ranks waited for it, as a percentage of the
    collective's time ``job_seconds``.

    ``inside_seconds[r]`` is the time rank r spent inside the collective calls. A rank that
    arrives late spends the least time inside (its peers are already waiting), and each of its
    peers spends that much longer; so the wait it caused is the median of the others' time
    inside minus its own (0 when negative)."""
    if len(inside_seconds) < 2:
        raise ValueError("waiting needs at least 2 ranks")
    if job_seconds <= 0:
        raise ValueError(f"job_seconds must be > 0, got {job_seconds}")
    out = []
    for i, own in enumerate(inside_seconds):
        peers = statistics.median([t for j, t in enumerate(inside_seconds) if j != i])
        out.append(100.0 * max(0.0, peers - own) / job_seconds)
    return out


def matmul_flops(m: int, n: int, k: int) -> int:
    """Floating-point operations of one dense (m x k) @ (k x n) product: 2mnk."""
    return 2 * m * n * k
