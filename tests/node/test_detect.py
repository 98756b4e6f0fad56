"""Detection: parsing of system files, and a detected profile that validates."""

from __future__ import annotations

import os
import tomllib

from dsconform.node import detect
from dsconform.node.detect import GpuInfo, NodeFacts, NvmeDevice
from dsconform.profile import schema as profile
from dsconform.profile import toml_writer as toml_out
from dsconform.profile.select import auto_select, matches, rendezvous_nodes

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
/dev/nvme0n1p1 /mnt/nvme ext4 rw 0 0
/dev/nvme1n1 /mnt/with\\040space xfs rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
"""


def fake_node(n_gpus=2, name="NVIDIA H200", cc="9.0", mem=143771 << 20):
    return NodeFacts(hostname="h", python="3.12", cpu_cores=32, host_memory_bytes=256 << 30,
                     shm_bytes=256 << 30, torch_version="2.11.0", deepspeed_version="0.19.8",
                     cuda_version="13.0", driver_version="580.159.04", nccl_version="2.28.9",
                     gpus=[GpuInfo(name, mem, cc) for _ in range(n_gpus)])


def test_parse_mounts_maps_partitions_to_disks():
    assert detect.parse_mounts(MOUNTS) == {"nvme0n1": ["/mnt/nvme"],
                                           "nvme1n1": ["/mnt/with space"]}


def test_probe_nvme_from_sysfs(tmp_path):
    dev = tmp_path / "block" / "nvme0n1"
    (dev / "device").mkdir(parents=True)
    (dev / "device" / "model").write_text("Samsung PM1743\n")
    (dev / "size").write_text("7501476528\n")
    (tmp_path / "mounts").write_text(MOUNTS)
    [d] = detect.probe_nvme(tmp_path / "block", tmp_path / "mounts")
    assert d == NvmeDevice("nvme0n1", "Samsung PM1743", 7501476528 * 512, ["/mnt/nvme"])


def test_probe_real_node_is_consistent():
    facts = detect.probe()
    assert facts.cpu_cores >= 1 and facts.torch_version
    assert facts.accelerator == ("cuda" if facts.gpus else "cpu")


def roundtrip(facts):
    text = toml_out.dumps(detect.profile_data(facts))
    return profile.from_data(tomllib.loads(text), "detected")


def test_detected_profile_validates_gpu_and_cpu():
    p = roundtrip(fake_node())
    assert (p.gpu_count, p.gpu_model, p.gpu_min_memory_gib, p.gpu_compute_capability) == \
        (2, "NVIDIA H200", 140, "9.0")
    assert p.name == "detected-h200-x2" and p.nccl_min_version == "2.28.9"
    assert roundtrip(fake_node(0)).gpu_count == 0
    assert roundtrip(detect.probe()).name.startswith("detected-")


def test_detected_profile_promises_what_was_found():
    node = fake_node()
    p = roundtrip(node)
    assert matches(p, node)


def test_bf16_from_compute_capability():
    assert fake_node(cc="8.0").bf16 and not fake_node(cc="7.0").bf16
    assert fake_node(0).bf16  # the CPU accelerator
    assert not fake_node(0).fp16  # only with oneDNN fp16 kernels
    cpu = fake_node(0)
    cpu.cpu_fp16 = True
    assert cpu.fp16


def test_auto_select_picks_shipped_or_detected():
    p, how = auto_select(fake_node())
    assert p.name == "h200-x2" and "matches shipped" in how
    p, how = auto_select(fake_node(0))
    assert p.name == "cpu-ci"
    p, _ = auto_select(fake_node(8, "NVIDIA H100 80GB HBM3", mem=81559 << 20))
    assert p.name == "h100-x8"


def test_auto_composes_a_catalogued_model_with_its_floors_and_the_ops_training_needs():
    """A node of a catalogued model that no shipped profile describes gets the model's floors
    (and says which entry), never a profile without floors; the ops training needs on a GPU
    node are promised (async_io only where libaio is there, gds only with nvidia-fs)."""
    from dsconform.profile import catalogue
    node = fake_node(4)
    node.libaio = True
    p, how = auto_select(node)
    h200 = catalogue.shipped()["h200"]
    assert p.name == "auto-h200-x4" and p.source == "catalogue:h200" and p.gpu_catalogue == "h200"
    assert "h200 (NVIDIA H200)" in how and "no floors" not in how
    assert (p.matmul_bf16_tflops, p.matmul_fp16_tflops, p.hbm_gbps, p.h2d_gbps, p.d2h_gbps) == \
        tuple(h200.floor(f) for f in catalogue.FLOOR_FIELDS)
    assert p.ops == ("fused_adam", "cpu_adam", "async_io") and not p.nccl_floors
    node.libaio, node.nvidia_fs = False, True
    assert auto_select(node)[0].ops == ("fused_adam", "cpu_adam", "gds")


def test_auto_keeps_the_detected_profile_for_a_model_not_in_the_catalogue():
    p, how = auto_select(fake_node(2, "NVIDIA RTX 6000 Ada Generation", cc="8.9"))
    assert p.name == "detected-rtx-6000-ada-generation-x2" and "no floors" in how
    assert p.matmul_bf16_tflops is None and p.hbm_gbps is None
    assert p.ops == ("fused_adam", "cpu_adam")  # what training needs, whatever the model
    assert auto_select(fake_node(0))[0].ops != ()  # cpu-ci names what CI builds


def test_rendezvous_nodes():
    assert rendezvous_nodes({}) == 1
    assert rendezvous_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert rendezvous_nodes({"SLURM_NNODES": "4", "MASTER_ADDR": "n0"}) == 4
    assert rendezvous_nodes({"SLURM_NNODES": "4"}) == 1  # an allocation, not a rendezvous


# ------------------------------------------------------------------ GPUs present, without torch

def _pci_tree(root, devices):
    """devices: {bus id: (vendor, class)}"""
    for bus, (vendor, cls) in devices.items():
        d = root / bus
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")


def _proc_tree(root, gpus):
    for bus, model in gpus.items():
        d = root / bus
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ:   42\nBus Location: {bus}\n")


def test_pci_counts_nvidia_display_functions_only(tmp_path):
    _pci_tree(tmp_path / "pci", {
        "0000:18:00.0": ("0x10de", "0x030200"),   # H200: 3D controller
        "0000:2a:00.0": ("0x10de", "0x030000"),   # VGA controller
        "0000:05:00.0": ("0x10de", "0x068000"),   # NVSwitch: a bridge, not a GPU
        "0000:19:00.1": ("0x10de", "0x040300"),   # a consumer card's audio function
        "0000:00:02.0": ("0x1af4", "0x010000"),   # virtio disk
    })
    hw = detect.probe_gpu_hardware(nvml=False, proc_root=tmp_path / "none",
                                   pci_root=tmp_path / "pci")
    assert (hw.count, hw.source, hw.bus_ids) == (2, "pci", ["0000:18:00.0", "0000:2a:00.0"])
    assert hw.models == [] and hw.model is None


def test_largest_count_wins_and_names_come_from_the_driver(tmp_path):
    """One GPU fell off the driver (NVML and /proc see 1) but is still on the PCI bus: 2."""
    _proc_tree(tmp_path / "proc", {"0000:18:00.0": "NVIDIA H200"})
    _pci_tree(tmp_path / "pci", {"0000:18:00.0": ("0x10de", "0x030200"),
                                 "0000:2a:00.0": ("0x10de", "0x030200")})
    hw = detect.probe_gpu_hardware(nvml=False, proc_root=tmp_path / "proc",
                                   pci_root=tmp_path / "pci")
    assert hw.count == 2 and hw.source == "pci" and hw.model == "NVIDIA H200"
    assert hw.seen == {"/proc/driver/nvidia": 1, "pci": 2}


def test_no_nvidia_hardware(tmp_path):
    hw = detect.probe_gpu_hardware(nvml=False, proc_root=tmp_path / "a", pci_root=tmp_path / "b")
    assert (hw.count, hw.source) == (0, "none")


def test_real_probe_never_raises_and_counts_at_least_torch():
    facts = detect.probe()
    assert facts.gpus_present >= facts.gpu_count
    assert facts.is_gpu_node == (facts.gpus_present > 0)


def broken_node(present=2, usable=0):
    """2x H200 on the bus, torch sees `usable` of them."""
    node = fake_node(usable)
    node.hardware = detect.GpuHardware(count=present, models=["NVIDIA H200"] * present,
                                       bus_ids=[f"0000:{i:02x}:00.0" for i in range(present)],
                                       source="nvml", seen={"nvml": present})
    return node


def test_auto_is_not_self_fulfilling_on_a_broken_node(monkeypatch):
    """torch sees no GPU, the hardware has 2 H200: auto picks h200-x2 (whose promises will
    fail), not cpu-ci and not a detected profile of 0 GPUs."""
    node = broken_node()
    assert node.gpu_count == 0 and node.gpus_present == 2 and node.is_gpu_node
    p, how = auto_select(node)
    assert p.name == "h200-x2", how
    assert "2x NVIDIA H200 present (nvml), 0 usable" in how
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert node.unusable_gpus() == ("2 GPUs present (nvml: NVIDIA H200), 0 usable by torch; "
                                    "CUDA_VISIBLE_DEVICES='' is set")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "check the driver" in broken_node(2, 1).unusable_gpus()
    assert fake_node(2).unusable_gpus() is None


def test_detected_fallback_promises_the_hardware_count():
    """A 4-GPU node matches no shipped profile; with 3 usable its composed profile still
    promises 4, so the promise test fails instead of passing what is left."""
    p, how = auto_select(broken_node(4, 3))
    assert p.source == "catalogue:h200" and p.gpu_count == 4 and p.name == "auto-h200-x4"
    assert "no shipped profile matches (4x NVIDIA H200 present (nvml), 3 usable)" in how
    p = roundtrip(broken_node(2, 0))  # torch sees none: the hardware's model is promised
    assert (p.gpu_count, p.gpu_model) == (2, "NVIDIA H200")


# --- what a process may use: affinity and cgroup limits ----------------------------------------

def _cgroup(tmp_path, files: dict[str, str], proc: str) -> tuple:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    proc_cgroup = tmp_path / "proc_cgroup"
    proc_cgroup.write_text(proc)
    return root, proc_cgroup


def test_cgroup_v2_quota_and_memory_limit_cap_the_host(tmp_path):
    """A pod limited to 4 CPUs and 8 GiB on a big host: the promises see 4 and 8 GiB."""


    root, proc = _cgroup(tmp_path, {"kubepods/pod1/cpu.max": "400000 100000",
                                    "kubepods/pod1/memory.max": str(8 << 30)},
                         "0::/kubepods/pod1\n")
    cores, how = detect.usable_cpu_cores(root, proc, affinity=128)
    assert cores == 4 and "capped by a cgroup CPU quota of 4" in how, how
    mem, how = detect.usable_memory_bytes(root, proc, meminfo=2 << 40)
    assert mem == 8 << 30 and "8.0 GiB" in how, how


def test_cgroup_v2_without_limits_and_a_fractional_quota(tmp_path):


    root, proc = _cgroup(tmp_path, {"cpu.max": "max 100000", "memory.max": "max"}, "0::/\n")
    assert detect.usable_cpu_cores(root, proc, affinity=16)[0] == 16
    assert detect.usable_memory_bytes(root, proc, meminfo=64 << 30) == (64 << 30, "MemTotal")
    root, proc = _cgroup(tmp_path / "b", {"cpu.max": "250000 100000"}, "0::/\n")
    assert detect.usable_cpu_cores(root, proc, affinity=16)[0] == 3  # 2.5 CPUs: 3 may run


def test_cgroup_v1_limits_and_affinity(tmp_path):
    """cgroup v1 (a Slurm job or Docker on an older host): quota per controller directory; an
    affinity mask narrower than the quota wins; v1's 'no limit' is a page-rounded 2**63."""


    root, proc = _cgroup(tmp_path, {"cpu/slurm/job7/cpu.cfs_quota_us": "800000",
                                    "cpu/slurm/job7/cpu.cfs_period_us": "100000",
                                    "memory/slurm/job7/memory.limit_in_bytes": str(32 << 30)},
                         "4:memory:/slurm/job7\n2:cpu,cpuacct:/slurm/job7\n")
    assert detect.usable_cpu_cores(root, proc, affinity=64)[0] == 8
    assert detect.usable_cpu_cores(root, proc, affinity=6) == (
        6, f"6 in the affinity mask of {os.cpu_count() or 0} on the host")
    assert detect.usable_memory_bytes(root, proc, meminfo=512 << 30)[0] == 32 << 30
    root, proc = _cgroup(tmp_path / "b", {"memory/memory.limit_in_bytes":
                                          "9223372036854771712",
                                          "cpu/cpu.cfs_quota_us": "-1",
                                          "cpu/cpu.cfs_period_us": "100000"},
                         "4:memory:/\n2:cpu,cpuacct:/\n")
    assert detect.usable_memory_bytes(root, proc, meminfo=512 << 30)[0] == 512 << 30
    assert detect.usable_cpu_cores(root, proc, affinity=64)[0] == 64


def test_gpu_slowdown_reasons_name_the_gpu_and_the_cause():
    """Idle, application clocks and a software power cap are not faults; hardware, thermal and
    power-brake slowdowns are, each named with the GPU's index and bus id."""
    from dsconform.node import gpu_health

    fine = [(0, "0000:18:00.0", 0x1), (1, "0000:2a:00.0", 0x2 | 0x4 | 0x10)]
    assert gpu_health.slowdown_problems(fine) == []
    hot = [(0, "0000:18:00.0", 0x1), (1, "0000:2a:00.0", 0x40 | 0x4)]
    [line] = gpu_health.slowdown_problems(hot)
    assert line.startswith("GPU 1 (PCI 0000:2a:00.0): hardware thermal slowdown"), line
    assert "reasons mask 0x44" in line
    for bit in (0x8, 0x20, 0x80):
        assert gpu_health.slowdown_problems([(3, None, bit)]), bit


def test_clock_event_reasons_read_through_nvml(monkeypatch):
    """The reader takes NVML's newer name when it exists and the older one otherwise."""
    import sys
    import types

    from dsconform.node import gpu_health

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:1{h}:00.0".encode()),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x40 if h else 0x1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = gpu_health.read_clock_event_reasons()
    assert [(i, m) for i, _, m in got] == [(0, 0x1), (1, 0x40)]
    assert got[1][1] == gpu_health.canonical_bus_id("00000000:11:00.0")


def test_gpu_memory_in_use_reads_nvml_and_survives_its_absence(monkeypatch):
    import sys
    import types

    def procs(*pids):
        return lambda h: [types.SimpleNamespace(pid=p) for p in pids]

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(80 << 30) if h else 0),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs(4242)(h) if h else [],
        nvmlDeviceGetGraphicsRunningProcesses=procs())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert detect.gpu_memory_in_use() == [(0, []), (80 << 30, [4242])]

    def refuse():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=refuse))
    assert detect.gpu_memory_in_use() == []


def test_a_gpu_held_at_start_fails_the_profile(monkeypatch):
    """PROF-GPU-7 on facts shaped like the probe's: 80 GiB held by pid 4242 on GPU 1 fails,
    naming GPU and pid; 0.5 GiB of driver reservations passes; no NVML reading fails."""
    import pytest

    from suites import test_profile as suite

    prof = types_profile(gpu_count=2)
    held = _node([(512 << 20, []), (80 << 30, [4242])])
    with pytest.raises(AssertionError, match=r"GPU 1: 80.0 GiB in use \(pids 4242\)"):
        suite.test_gpus_free_at_start(prof, held)
    suite.test_gpus_free_at_start(prof, _node([(512 << 20, []), (0, [])]))
    with pytest.raises(pytest.fail.Exception, match="NVML could not be read"):
        suite.test_gpus_free_at_start(prof, _node([]))


def _node(at_start):
    node = fake_node()
    node.gpu_memory_at_start = at_start
    return node


def types_profile(**kw):
    import types

    return types.SimpleNamespace(name="p", source="test", **kw)
