"""Probe the node: what it has, as facts the gates and promise checks compare with a profile.

Probes are cheap and never raise: a probe that cannot answer leaves ``None`` (unknown), which the
gates report as "found unknown" rather than crashing a run.

GPUs are counted twice, on purpose. The *usable* GPUs come from torch (which honours
CUDA_VISIBLE_DEVICES and needs a working driver/CUDA pair); the GPUs *present* are counted
without torch: NVML, else /proc/driver/nvidia/gpus, else the PCI bus (vendor 0x10de, display
class), the largest count wins. A node whose torch sees fewer GPUs than the hardware has is
broken, and profile selection (``--profile auto``) goes by the hardware, so a broken node can
never choose a profile that promises only what still works.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsconform.node import buildenv
from dsconform.units import GIB


@dataclass
class GpuInfo:
    name: str
    memory_bytes: int
    compute_capability: str  # "9.0"

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


@dataclass
class GpuHardware:
    """The NVIDIA GPUs on the node's buses, counted without torch."""
    count: int = 0
    models: list[str] = field(default_factory=list)  # one per GPU where the source names them
    bus_ids: list[str] = field(default_factory=list)
    source: str = "none"  # "nvml", "/proc/driver/nvidia", "pci" or "none"
    # What each source said, for the report: {"nvml": 2, "pci": 2} or {"nvml": "error ..."}
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str | None:
        names = sorted(set(self.models))
        return " / ".join(names) if names else None


@dataclass
class NvmeDevice:
    device: str  # nvme0n1
    model: str | None
    size_bytes: int | None
    mounts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML lists as running compute on a GPU."""

    gpu: int  # NVML index
    pid: int
    name: str  # the process name, or why it has none here
    used_bytes: int | None = None

    def describe(self) -> str:
        mem = f", {self.used_bytes / 2**20:.0f} MiB" if self.used_bytes else ""
        return f"pid {self.pid} ({self.name}{mem})"


@dataclass
class NodeFacts:
    hostname: str
    python: str
    cpu_cores: int
    host_memory_bytes: int | None
    shm_bytes: int | None
    torch_version: str | None
    deepspeed_version: str | None
    cuda_version: str | None = None  # torch's CUDA runtime
    driver_version: str | None = None
    nccl_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    nvme: list[NvmeDevice] = field(default_factory=list)
    # DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (AVX512-FP16/AMX):
    # the AMD EPYC CI machine does not, the Xeon one with AVX512-FP16 does
    # (docs/findings.md#cpu-machine).
    cpu_fp16: bool = False
    # The GPUs present, counted without torch (see the module docstring).
    hardware: GpuHardware = field(default_factory=GpuHardware)
    # Per NVML index, read before this process touched CUDA: (bytes in use, the pids NVML lists
    # on the GPU). Empty where NVML could not be read.
    gpu_memory_at_start: list[tuple[int, list[int]]] = field(default_factory=list)
    # Read at the same moment: the processes running compute on each GPU, and each GPU's highest
    # utilization (%) over a short idle sample (None where NVML could not read it).
    compute_at_start: list[GpuProcess] = field(default_factory=list)
    utilization_at_start: list[int | None] = field(default_factory=list)
    # What DeepSpeed's JIT builds of async_io and gds need on this machine.
    libaio: bool = False  # libaio's header and library (libaio-dev)
    nvidia_fs: bool = False  # the nvidia-fs kernel module GPUDirect Storage needs

    @property
    def gpu_count(self) -> int:
        """GPUs torch can use."""
        return len(self.gpus)

    @property
    def gpus_present(self) -> int:
        """GPUs the hardware has; never fewer than torch can use."""
        return max(self.hardware.count, self.gpu_count)

    @property
    def is_gpu_node(self) -> bool:
        """NVIDIA GPUs are present, whether or not torch can use them."""
        return self.gpus_present > 0

    @property
    def present_model(self) -> str | None:
        """The GPU model by the hardware's own account, else torch's."""
        return self.hardware.model or self.gpu_model

    def unusable_gpus(self) -> str | None:
        """Why fewer GPUs are usable than present, in one line; None when all are usable."""
        if self.gpu_count >= self.gpus_present:
            return None
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = (f"; CUDA_VISIBLE_DEVICES={cvd!r} is set" if cvd is not None
                else "; check the driver and CUDA versions (nvidia-smi) and dmesg for Xid errors")
        return (f"{self.gpus_present} GPUs present ({self.hardware.source}"
                f"{': ' + self.hardware.model if self.hardware.model else ''}), "
                f"{self.gpu_count} usable by torch{hint}")

    @property
    def accelerator(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def gpu_model(self) -> str | None:
        names = sorted({g.name for g in self.gpus})
        return " / ".join(names) if names else None

    @property
    def bf16(self) -> bool:
        if self.gpus:  # Ampere (8.0) and newer do bf16 in hardware
            return all(_cc_tuple(g.compute_capability) >= (8, 0) for g in self.gpus)
        return True  # DeepSpeed's CPU accelerator runs bf16 (docs/findings.md#cpu-machine)

    @property
    def fp16(self) -> bool:
        if self.gpus:
            return all(_cc_tuple(g.compute_capability) >= (6, 0) for g in self.gpus)
        return self.cpu_fp16

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gpu_count=self.gpu_count, accelerator=self.accelerator, gpu_model=self.gpu_model,
                 gpus_present=self.gpus_present)
        return d


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, _, minor = cc.partition(".")
    return int(major), int(re.sub(r"\D.*", "", minor) or 0)


def dist_version(name: str) -> str | None:
    """An installed distribution's version without importing it (None if absent)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cgroup_dirs(controller: str, root: Path = Path("/sys/fs/cgroup"),
                 proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Path]:
    """The directories that may hold this process's limits for a cgroup ``controller``,
    innermost first: its own cgroup (v2: ``0::/path`` under ``root``; v1: ``N:cpu,cpuacct:/path``
    under ``root/cpu``), then the hierarchy's root (a container sees its own cgroup there)."""
    dirs = []
    for line in (_read(proc_cgroup) or "").splitlines():
        _, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        base = root if ctrls == "" else root / controller if controller in ctrls.split(",") \
            else None
        if base is not None:
            if path.strip("/"):
                dirs.append(base / path.strip("/"))
            dirs.append(base)
    return dirs + [root, root / controller]


def _first(dirs: list[Path], name: str) -> str | None:
    for d in dirs:
        text = _read(d / name)
        if text:
            return text
    return None


def usable_cpu_cores(root: Path = Path("/sys/fs/cgroup"),
                     proc_cgroup: Path = Path("/proc/self/cgroup"),
                     affinity: int | None = None) -> tuple[int, str]:
    """(cores this process may run on, how that was decided): the CPUs in its affinity mask
    (a Slurm job's or a pinned container's), capped by a cgroup CPU quota (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) rounded up. os.cpu_count() counts the host."""
    host = os.cpu_count() or 0
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host
    cores, how = affinity, f"{affinity} in the affinity mask of {host} on the host"
    dirs = _cgroup_dirs("cpu", root, proc_cgroup)
    quota = None
    v2 = _first(dirs, "cpu.max")
    if v2:
        q, _, period = v2.partition(" ")
        if q != "max" and period:
            quota = int(q) / int(period)
    else:
        q, period = _first(dirs, "cpu.cfs_quota_us"), _first(dirs, "cpu.cfs_period_us")
        if q and period and int(q) > 0:
            quota = int(q) / int(period)
    if quota is not None and math.ceil(quota) < cores:
        cores = math.ceil(quota)
        how += f", capped by a cgroup CPU quota of {quota:g}"
    return cores, how


def usable_memory_bytes(root: Path = Path("/sys/fs/cgroup"),
                        proc_cgroup: Path = Path("/proc/self/cgroup"),
                        meminfo: int | None = None) -> tuple[int | None, str]:
    """(host memory this process may use, how that was decided): /proc/meminfo's MemTotal,
    capped by a cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; "max"
    or v1's page-rounded 2**63 mean none)."""
    total = _meminfo_bytes() if meminfo is None else meminfo
    dirs = _cgroup_dirs("memory", root, proc_cgroup)
    limit = None
    v2 = _first(dirs, "memory.max")
    if v2:
        limit = None if v2 == "max" else int(v2)
    else:
        v1 = _first(dirs, "memory.limit_in_bytes")
        if v1 and int(v1) < (1 << 62):
            limit = int(v1)
    if limit is not None and (total is None or limit < total):
        return limit, f"capped by a cgroup memory limit of {limit / 2**30:.1f} GiB"
    return total, "MemTotal"


def _meminfo_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def shm_bytes() -> int | None:
    """Size of /dev/shm in bytes (None if it cannot be read)."""
    try:
        st = os.statvfs("/dev/shm")
        return st.f_frsize * st.f_blocks
    except OSError:
        return None


def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py: no CUDA context needed

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20)
            lines = out.stdout.split()
            return lines[0] if out.returncode == 0 and lines else None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


# PCI class codes of GPUs: 0x0300xx VGA controller, 0x0302xx 3D controller. NVIDIA's NVSwitches
# (0x0680xx) and the audio function of consumer cards (0x0403xx) share the vendor id.
NVIDIA_PCI_VENDOR = "0x10de"
_GPU_PCI_CLASSES = ("0x0300", "0x0302")


@contextlib.contextmanager
def nvml_devices() -> Iterator[tuple[Any, list[Any]]]:
    """(the pynvml module, every GPU's handle in NVML index order, nvidia-smi's numbering) with
    NVML initialised for the duration (no CUDA context); raises when NVML is missing or
    cannot initialise."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        yield pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def nvml_text(value: Any) -> str:
    """NVML strings come as bytes from older bindings, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else value


def _nvml_gpus() -> tuple[list[str], list[str]]:
    """(names, bus ids) from NVML; raises when NVML is missing or cannot initialise."""
    with nvml_devices() as (nvml, handles):
        return ([nvml_text(nvml.nvmlDeviceGetName(h)) for h in handles],
                [nvml_text(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles])


def _proc_gpus(root: Path) -> tuple[list[str], list[str]]:
    """(names, bus ids) from the driver's /proc/driver/nvidia/gpus/<bus id>/information."""
    names, buses = [], []
    for d in sorted(root.glob("*")):
        info = _read(d / "information") or ""
        m = re.search(r"^Model:\s*(.+)$", info, re.M)
        names.append(m.group(1).strip() if m else "")
        buses.append(d.name)
    return names, buses


def _pci_gpus(root: Path) -> list[str]:
    """Bus ids of NVIDIA display-class PCI functions: what is plugged in, driver or not."""
    found = []
    for d in sorted(root.glob("*")):
        if (_read(d / "vendor") or "").lower() == NVIDIA_PCI_VENDOR and \
                (_read(d / "class") or "").lower().startswith(_GPU_PCI_CLASSES):
            found.append(d.name)
    return found


def probe_gpu_hardware(*, nvml: bool = True,
                       proc_root: Path = Path("/proc/driver/nvidia/gpus"),
                       pci_root: Path = Path("/sys/bus/pci/devices")) -> GpuHardware:
    """Count the NVIDIA GPUs present without torch. Every source is asked; the largest count
    wins (a GPU the driver lost still shows on the PCI bus). Never raises."""
    hw = GpuHardware()
    candidates: list[tuple[str, list[str], list[str]]] = []
    if nvml:
        try:
            names, buses = _nvml_gpus()
            candidates.append(("nvml", names, buses))
            hw.seen["nvml"] = len(names)
        except Exception as e:  # no library, no driver: NVML_ERROR_LIBRARY_NOT_FOUND etc.
            hw.seen["nvml"] = f"unavailable ({type(e).__name__}: {e})"[:200]
    names, buses = _proc_gpus(proc_root)
    if buses:
        candidates.append(("/proc/driver/nvidia", names, buses))
        hw.seen["/proc/driver/nvidia"] = len(buses)
    pci = _pci_gpus(pci_root)
    if pci:
        candidates.append(("pci", [], pci))
        hw.seen["pci"] = len(pci)
    if candidates:
        # The largest count; among equal counts the first (most descriptive) source.
        source, names, buses = max(candidates, key=lambda c: len(c[2]))
        named = next((c[1] for c in candidates if c[1] and any(c[1])), [])
        hw.count, hw.source, hw.bus_ids = len(buses), source, list(buses)
        hw.models = [n for n in (names if any(names) else named) if n]
    return hw


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception:
        return {}
    facts: dict[str, Any] = {"cuda_version": torch.version.cuda, "gpus": []}
    try:  # the same test DeepSpeed's CPU accelerator makes (is_fp16_supported)
        facts["cpu_fp16"] = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        facts["cpu_fp16"] = False
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append(GpuInfo(p.name, int(p.total_memory), f"{p.major}.{p.minor}"))
        try:
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            facts["nccl_version"] = None
    return facts


def parse_mounts(text: str) -> dict[str, list[str]]:
    """/proc/mounts text -> {device basename: [mount points]} for NVMe block devices."""
    mounts: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("/dev/nvme"):
            dev = Path(parts[0]).name
            disk = re.sub(r"p\d+$", "", dev)  # nvme0n1p1 -> nvme0n1
            mounts.setdefault(disk, []).append(parts[1].replace("\\040", " "))
    return mounts


def probe_nvme(sys_block: Path = Path("/sys/block"), mounts_file: Path = Path("/proc/mounts"),
               ) -> list[NvmeDevice]:
    try:
        mounts = parse_mounts(mounts_file.read_text())
    except OSError:
        mounts = {}
    devices = []
    for dev in sorted(sys_block.glob("nvme*")):
        model = _read(dev / "device" / "model")
        sectors = _read(dev / "size")
        size = int(sectors) * 512 if sectors and sectors.isdigit() else None
        devices.append(NvmeDevice(dev.name, model, size, mounts.get(dev.name, [])))
    return devices


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def gpu_memory_in_use() -> list[tuple[int, list[int]]]:
    """Per NVML index: (bytes in use, pids of the compute and graphics processes NVML lists).
    [] when NVML is missing or refuses. Read it before any process of the run holds a CUDA
    context: what is in use then belongs to someone else (a leftover job, another user)."""
    try:
        with nvml_devices() as (nvml, handles):
            out = []
            for h in handles:
                pids = set()
                for lister in ("nvmlDeviceGetComputeRunningProcesses",
                               "nvmlDeviceGetGraphicsRunningProcesses"):
                    try:
                        pids |= {int(p.pid) for p in getattr(nvml, lister)(h)}
                    except Exception:
                        pass
                out.append((int(nvml.nvmlDeviceGetMemoryInfo(h).used), sorted(pids)))
            return out
    except Exception:
        return []


def process_name(pid: int) -> str:
    """A process's name, or why it has none from here (another container's PID namespace)."""
    try:
        import psutil
        return psutil.Process(pid).name()
    except Exception:
        return "not visible from here: another container or user"


def compute_processes(nvml: Any, handles: list[Any]) -> list[GpuProcess]:
    """Every process NVML lists as running compute, on every GPU (NVML index order)."""
    found = []
    for index, handle in enumerate(handles):
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            continue
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            found.append(GpuProcess(index, int(proc.pid), process_name(int(proc.pid)),
                                    int(used) if isinstance(used, int) else None))
    return found


#: Idle-utilization sampling at the start of a run: how many reads, how far apart.
UTILIZATION_SAMPLES, UTILIZATION_EVERY_S = 5, 0.1


def gpu_activity() -> tuple[list[GpuProcess], list[int | None]]:
    """The compute processes on each GPU and each GPU's highest utilization over a short sample
    (UTILIZATION_SAMPLES reads UTILIZATION_EVERY_S apart); ([], []) without NVML."""
    import time
    try:
        with nvml_devices() as (nvml, handles):
            procs = compute_processes(nvml, handles)
            highest: list[int | None] = [None] * len(handles)
            for k in range(UTILIZATION_SAMPLES):
                for i, h in enumerate(handles):
                    try:
                        util = int(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                    except Exception:
                        continue
                    highest[i] = util if highest[i] is None else max(highest[i], util)
                if k + 1 < UTILIZATION_SAMPLES:
                    time.sleep(UTILIZATION_EVERY_S)
            return procs, highest
    except Exception:
        return [], []


def probe() -> NodeFacts:
    """Probe this node (imports torch; does not import DeepSpeed or create CUDA contexts
    beyond what torch.cuda.get_device_properties needs)."""
    at_start = gpu_memory_in_use()  # before torch initialises CUDA in this process
    compute, utilization = gpu_activity()
    tf = _torch_facts()
    gpus = tf.get("gpus", [])
    hardware = probe_gpu_hardware()
    return NodeFacts(
        hostname=socket.gethostname(),
        python=platform.python_version(),
        cpu_cores=usable_cpu_cores()[0],
        host_memory_bytes=usable_memory_bytes()[0],
        shm_bytes=shm_bytes(),
        torch_version=dist_version("torch"),
        deepspeed_version=dist_version("deepspeed"),
        cuda_version=tf.get("cuda_version"),
        driver_version=_driver_version() if gpus or hardware.count else None,
        nccl_version=tf.get("nccl_version"),
        gpus=gpus,
        nvme=probe_nvme(),
        cpu_fp16=tf.get("cpu_fp16", False),
        hardware=hardware,
        gpu_memory_at_start=at_start,
        compute_at_start=compute,
        utilization_at_start=utilization,
        libaio=buildenv.libaio_present(),
        nvidia_fs=buildenv.nvidia_fs_loaded(),
    )


# ------------------------------------------------------------------ profile from facts

def profile_data(facts: NodeFacts, name: str | None = None) -> dict[str, Any]:
    """A valid profile describing ``facts``: every promise is what was found, no floors.

    The GPU count is the hardware's (``gpus_present``), not torch's: a node whose torch lost a
    GPU must not describe itself as having fewer.
    """
    gpus: dict[str, Any] = {"count": facts.gpus_present}
    model = facts.present_model
    if facts.gpus:
        first = facts.gpus[0]
        gpus.update(
            model=first.name,
            # Round down to whole GiB: the promise must hold on the node it was made from.
            min_memory_gib=int(min(g.memory_gib for g in facts.gpus)),
            compute_capability=first.compute_capability,
            bf16=facts.bf16,
            fp16=facts.fp16,
        )
    elif model and " / " not in model:
        gpus["model"] = model  # torch sees none: the hardware's name is all there is
    if name is None:
        if facts.is_gpu_node:
            slug = re.sub(r"[^a-z0-9]+", "-", (model or "gpu").lower().replace("nvidia", ""))
            name = f"detected-{slug.strip('-') or 'gpu'}-x{facts.gpus_present}"
        else:
            name = "detected-cpu"
    desc = f"detected on {facts.hostname}: {facts.cpu_cores} cores"
    if facts.is_gpu_node:
        desc += (f", {facts.gpus_present}x {model or 'NVIDIA GPU'} ({facts.gpu_count} usable), "
                 f"driver {facts.driver_version}")
    data: dict[str, Any] = {"profile": {"name": name, "description": desc}, "gpus": gpus}
    if facts.nccl_version:
        data["nccl"] = {"min_version": facts.nccl_version}
    system: dict[str, Any] = {"min_cpu_cores": max(facts.cpu_cores, 1)}
    if facts.shm_bytes:
        system["min_shm_gib"] = round(facts.shm_bytes / GIB * 0.95, 1)
    data["system"] = system
    return data


def nvme_comment(facts: NodeFacts) -> str:
    if not facts.nvme:
        return "# No NVMe block device found: no [[nvme.paths]] promised."
    lines = ["# NVMe devices found (add [[nvme.paths]] with floors you measured):"]
    for d in facts.nvme:
        size = f"{d.size_bytes / 1e12:.2f} TB" if d.size_bytes else "size unknown"
        lines.append(f"#   {d.device} {d.model or ''} {size} mounted at "
                     f"{', '.join(d.mounts) or 'nothing'}")
    return "\n".join(lines)
