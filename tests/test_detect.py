"""Detection: parsing of system files, and a detected profile that validates."""

from __future__ import annotations

import tomllib

from dsconform import detect, profile, toml_out
from dsconform.detect import GpuInfo, NodeFacts, NvmeDevice
from dsconform.session import auto_select, matches, rendezvous_nodes

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
    p, how = auto_select(fake_node(4))
    assert p.name == "detected-h200-x4" and "no floors" in how and not p.nccl_floors
    p, _ = auto_select(fake_node(8, "NVIDIA H100 80GB HBM3", mem=81559 << 20))
    assert p.name == "h100-x8"


def test_rendezvous_nodes():
    assert rendezvous_nodes({}) == 1
    assert rendezvous_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert rendezvous_nodes({"SLURM_NNODES": "4", "MASTER_ADDR": "n0"}) == 4
    assert rendezvous_nodes({"SLURM_NNODES": "4"}) == 1  # an allocation, not a rendezvous
