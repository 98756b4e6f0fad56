"""Profile promises: the node MUST have what its hardware profile says it has.

These run first (the plugin orders them so): a node with 7 GPUs where the profile promises 8 is
known before any training starts. A field the profile leaves out is no promise: its test skips
and says so. Every failure names the value found.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from dsconform.suite import (
    GIB,
    external_rendezvous,
    gpu_health,
    neighbours,
    usable_cpu_cores,
    usable_memory_bytes,
    versions,
    xdist_worker,
)

CAPABILITY = "profile"


def _promised(value, field: str, profile):
    if value is None:
        pytest.skip(f"profile {profile.name} makes no promise about {field}")
    return value


@pytest.mark.anynode
def test_gpus_usable(node):
    """PROF-GPU-0: torch MUST be able to use every NVIDIA GPU the node has (counted without
    torch: NVML, the driver's /proc entries, the PCI bus)."""
    if not node.is_gpu_node:
        pytest.skip("no NVIDIA GPU on this node (NVML, /proc/driver/nvidia and the PCI bus "
                    "show none)")
    problem = node.unusable_gpus()
    assert problem is None, problem


@pytest.mark.gpu
def test_gpu_count(profile, node):
    """PROF-GPU-1: The node MUST show exactly the number of GPUs the profile promises."""
    want = _promised(profile.gpu_count, "gpus.count", profile)
    assert node.gpu_count == want, f"expected {want} GPUs, found {node.gpu_count}"


@pytest.mark.gpu
def test_gpu_model(profile, node):
    """PROF-GPU-2: Every GPU's name MUST contain the promised model string."""
    want = _promised(profile.gpu_model, "gpus.model", profile)
    wrong = [f"GPU {i}: {g.name}" for i, g in enumerate(node.gpus) if want.lower() not in
             g.name.lower()]
    assert not wrong, f"expected model {want!r}, found {'; '.join(wrong)}"


@pytest.mark.gpu
def test_gpu_memory(profile, node):
    """PROF-GPU-3: Every GPU MUST have at least the promised memory (GiB = 2**30 bytes)."""
    want = _promised(profile.gpu_min_memory_gib, "gpus.min_memory_gib", profile)
    small = [f"GPU {i}: {g.memory_gib:.1f} GiB" for i, g in enumerate(node.gpus)
             if g.memory_gib < want]
    assert not small, f"expected >= {want} GiB per GPU, found {'; '.join(small)}"


# Memory a GPU may show in use before the run touched it: the driver's own reservations and
# a monitoring agent's context stay far below this.
IDLE_GPU_MEMORY_GIB = 2.0


@pytest.mark.gpu
def test_gpus_free_at_start(profile, node):
    """PROF-GPU-7: No GPU MAY hold another process's memory when the run starts (a leftover job
    passes every capacity check and then leaves training short of memory). Read from NVML
    before this run created any CUDA context."""
    _promised(profile.gpu_count, "gpus.count", profile)
    if xdist_worker()[1] > 1 or external_rendezvous():
        pytest.skip("GPU memory at start is only judged in a run of its own (not under -n or a "
                    "launcher): its sibling processes may already hold contexts")
    if not node.gpu_memory_at_start:
        pytest.fail("NVML could not be read at the start of the run: the GPUs' memory in use "
                    "is unknown", pytrace=False)
    busy = [f"GPU {i}: {used / GIB:.1f} GiB in use" + (f" (pids {', '.join(map(str, pids))})"
                                                      if pids else "")
            for i, (used, pids) in enumerate(node.gpu_memory_at_start)
            if used > IDLE_GPU_MEMORY_GIB * GIB]
    assert not busy, (f"GPUs held by other processes before the run started (more than "
                      f"{IDLE_GPU_MEMORY_GIB:g} GiB): {'; '.join(busy)}")


@pytest.mark.gpu
def test_no_neighbour_at_start(profile, node):
    """PROF-GPU-8: No other process MAY compute on a GPU when the run starts, and every GPU MUST
    be idle then (a neighbour holding little memory still halves every measurement). Read
    from NVML before this run created any CUDA context: the running compute processes, and
    each GPU's utilization sampled idle."""
    _promised(profile.gpu_count, "gpus.count", profile)
    if not node.utilization_at_start:
        pytest.fail("NVML could not be read at the start of the run: whether another process "
                    "computes on the GPUs is unknown", pytrace=False)
    bus = [gpu_health.canonical_bus_id(b) or b for b in node.hardware.bus_ids]
    others = neighbours.neighbours(node.compute_at_start,
                                   neighbours.own_pids(neighbours.run_root()))
    found = [f"GPU {p.gpu}{f' ({bus[p.gpu]})' if p.gpu < len(bus) else ''}: {p.describe()}"
             for p in others]
    found += [f"GPU {i}{f' ({bus[i]})' if i < len(bus) else ''}: {pct}% utilization while "
              f"this run had not started on it" for i, pct in
              neighbours.busy_at_start(node.utilization_at_start)]
    assert not found, ("another process computes on the GPUs this run measures (it takes "
                       "their time, and every floor with it):\n  " + "\n  ".join(found))


@pytest.mark.gpu
@pytest.mark.run_last
def test_no_neighbour_during_the_run(profile, node, run):
    """PROF-GPU-9: No other process MAY compute on a GPU while the run runs: NVML's running
    compute processes, polled every second from the start, list only this run's own."""
    _promised(profile.gpu_count, "gpus.count", profile)
    watch = run.neighbours
    if watch is None:
        pytest.fail("the GPUs were not watched during the run", pytrace=False)
    seen = watch.found()
    if watch.polls == 0:
        pytest.fail(f"NVML's compute processes could not be read during the run: "
                    f"{watch.why or 'no poll completed'}", pytrace=False)
    assert not seen, (f"other processes computed on the GPUs during the run ({watch.polls} "
                      f"polls):\n  " + "\n  ".join(
                          s.describe([gpu_health.canonical_bus_id(b) or b
                                      for b in node.hardware.bus_ids]) for s in seen))


@pytest.mark.gpu
def test_no_gpu_slowdown(profile, node):
    """PROF-GPU-6: No GPU MAY report a hardware, thermal or power-brake slowdown (NVML clock
    event reasons): such a GPU can pass a short matmul and still train slowly."""
    _promised(profile.gpu_count, "gpus.count", profile)
    try:
        reasons = gpu_health.read_clock_event_reasons()
    except Exception as e:  # NVML missing or refusing: the driver check says why elsewhere
        pytest.fail(f"cannot read the GPUs' clock event reasons from NVML: {e}", pytrace=False)
    problems = gpu_health.slowdown_problems(reasons)
    assert not problems, "GPUs slowed down:\n  " + "\n  ".join(problems)


@pytest.mark.gpu
def test_compute_capability(profile, node):
    """PROF-GPU-4: Every GPU MUST have the promised compute capability."""
    want = _promised(profile.gpu_compute_capability, "gpus.compute_capability", profile)
    wrong = [f"GPU {i}: {g.compute_capability}" for i, g in enumerate(node.gpus)
             if g.compute_capability != want]
    assert not wrong, f"expected compute capability {want}, found {'; '.join(wrong)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_matmul(profile, node, dtype):
    """PROF-GPU-5: A promised half-precision dtype MUST run a matmul on every GPU with a sane
    result."""
    if getattr(profile, dtype) is not True:
        pytest.skip(f"profile {profile.name} makes no promise about gpus.{dtype}")
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=gen)
    b = torch.randn(256, 256, generator=gen)
    ref = a.double() @ b.double()
    for i in range(node.gpu_count):
        out = (a.to(f"cuda:{i}", torch_dtype) @ b.to(f"cuda:{i}", torch_dtype)).double().cpu()
        rel = ((out - ref).norm() / ref.norm()).item()
        # bf16 has 8 mantissa bits: ~4e-3 relative per rounding; 2e-2 catches garbage, not noise.
        assert rel < 2e-2, f"{dtype} matmul on cuda:{i}: relative error {rel:.3g} (limit 2e-2)"


@pytest.mark.gpu
def test_nccl_version(profile, node):
    """PROF-NCCL-1: torch's NCCL MUST be at least the promised minimum version."""
    want = _promised(profile.nccl_min_version, "nccl.min_version", profile)
    assert node.nccl_version, "expected NCCL, found none (torch built without NCCL?)"
    assert versions.at_least(node.nccl_version, want), \
        f"expected NCCL >= {want}, found {node.nccl_version}"


def _driver_cuda_version() -> str | None:
    """The newest CUDA the driver supports, from nvidia-smi's banner ("CUDA Version: 13.0")."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return m.group(1) if m else None


@pytest.mark.gpu
def test_cuda_driver_supports_torch(profile, node):
    """PROF-DRV-1: The driver MUST support the CUDA version torch was built with."""
    if not profile.check_cuda_driver:
        pytest.skip(f"profile {profile.name} makes no promise about system.check_cuda_driver")
    driver_cuda = _driver_cuda_version()
    assert driver_cuda, "expected nvidia-smi to report the driver's CUDA version, found none"
    assert node.cuda_version, "expected a CUDA build of torch, found a CPU build"
    assert versions.at_least(driver_cuda, node.cuda_version), (
        f"expected a driver supporting CUDA {node.cuda_version} (torch's), found driver "
        f"{node.driver_version} supporting CUDA {driver_cuda}")


@pytest.mark.anynode
def test_shm_size(profile, node):
    """PROF-SHM-1: /dev/shm MUST be at least the promised size (NCCL and DeepSpeed's shm comm use
    it)."""
    want = _promised(profile.min_shm_gib, "system.min_shm_gib", profile)
    found = (node.shm_bytes or 0) / GIB
    assert found >= want, f"expected /dev/shm >= {want} GiB, found {found:.2f} GiB"


@pytest.mark.anynode
def test_cpu_cores(profile, node):
    """PROF-CPU-1: The node MUST give this run at least the promised number of CPU cores (its
    affinity mask and cgroup quota, not the host's count)."""
    want = _promised(profile.min_cpu_cores, "system.min_cpu_cores", profile)
    assert node.cpu_cores >= want, (f"expected >= {want} CPU cores, found {node.cpu_cores} "
                                    f"({usable_cpu_cores()[1]})")


@pytest.mark.anynode
def test_host_memory(profile, node):
    """PROF-MEM-1: The node MUST give this run at least the promised host memory (MemTotal,
    capped by its cgroup's memory limit)."""
    want = _promised(profile.min_host_memory_gib, "system.min_memory_gib", profile)
    found = (node.host_memory_bytes or 0) / GIB
    assert found >= want, (f"expected >= {want} GiB host memory, found {found:.1f} GiB "
                           f"({usable_memory_bytes()[1]})")


@pytest.mark.anynode
def test_deepspeed_version(profile, node):
    """PROF-DS-1: The installed DeepSpeed MUST be at least the promised minimum version."""
    want = _promised(profile.deepspeed_min_version, "deepspeed.min_version", profile)
    assert node.deepspeed_version, "expected DeepSpeed installed, found none"
    assert versions.at_least(node.deepspeed_version, want), \
        f"expected DeepSpeed >= {want}, found {node.deepspeed_version}"


@pytest.mark.nvme
def test_nvme_paths_writable(profile, run):
    """PROF-NVME-1: Every promised NVMe path MUST exist and be writable."""
    scratch = run.scratch
    bad = []
    for entry in profile.nvme_paths:
        path = entry.resolve(scratch)
        if not path.is_dir():
            bad.append(f"{path}: no such directory")
            continue
        probe = path / ".dsconform-write-probe"
        try:
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            bad.append(f"{path}: not writable ({e.strerror})")
    assert not bad, f"expected writable NVMe paths, found {'; '.join(bad)}"
