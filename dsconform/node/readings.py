"""What the hardware error gate reads of a GPU and of the kernel log: plain dataclasses
(``dataclasses.asdict`` is their JSON), read by dsconform/node/health.py and judged by
dsconform/node/severity.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class RemappedRows:
    corrected: int
    uncorrected: int
    pending: bool
    failed: bool


@dataclass
class NvLink:
    link: int
    active: bool
    replay: int | None = None
    recovery: int | None = None
    crc_flit: int | None = None
    crc_data: int | None = None


@dataclass
class GpuSnapshot:
    """What NVML showed of one GPU at ``read_at`` (seconds since the epoch). None: not read
    (``not_supported`` or ``unreadable`` says why)."""
    index: int
    bus_id: str | None = None
    name: str | None = None
    read_at: float = 0.0
    persistence: bool | None = None
    ecc_enabled: bool | None = None
    uncorrected_volatile: int | None = None
    uncorrected_aggregate: int | None = None
    corrected_volatile: int | None = None
    corrected_aggregate: int | None = None
    remapped_rows: RemappedRows | None = None
    retired_pages_pending: bool | None = None
    pcie_replays: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    nvlinks: list[NvLink] = field(default_factory=list)
    recovery_action: int | None = None
    compute_processes: int | None = None
    not_supported: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)
    lost: str | None = None  # NVML_ERROR_GPU_IS_LOST
    reset_required: bool = False  # NVML_ERROR_RESET_REQUIRED

    @property
    def label(self) -> str:
        return f"GPU {self.index} (PCI {self.bus_id or 'unknown'})"


@dataclass(frozen=True)
class XidEvent:
    """An XID critical-error event from the NVML event set. NVML gives it no time: ``seen_at``
    is when the gate read it (it happened between the set's registration and then)."""
    bus_id: str | None
    xid: int
    seen_at: float



@dataclass(frozen=True)
class KernelXid:
    """One ``NVRM: Xid`` (GPU) or ``SXid`` (NVSwitch) line of the kernel log."""
    kind: str  # "Xid" or "SXid"
    code: int
    bus_id: str | None  # sysfs form; the NVSwitch's for an SXid
    seconds: float | None  # since boot, as dmesg stamps it
    at: float | None  # seconds since the epoch
    text: str

    @property
    def fatal(self) -> bool:
        return self.kind == "SXid" and bool(re.search(r"(?<!non-)\bfatal\b", self.text, re.I))

