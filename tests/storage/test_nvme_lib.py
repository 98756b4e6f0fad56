"""The DeepNVMe library's own logic (dsconform.storage.nvme, nvme_xcheck, nvme_tune, the nvme parts
of
ds_config and the profile schema): path checks that must refuse before writing, page-cache
measurement, the aio block the runtime reads, fio/dd parsing, the sweep's order and CLI.

Real filesystems where the check is about them (/dev/shm is tmpfs here, tmp_path is on disk);
fakes only where a condition cannot be produced as root on this machine (a read-only mount).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsconform.base.pairwise import uncovered_pairs
from dsconform.checks.dsconfig import ds_config
from dsconform.profile.schema import ProfileError, from_data
from dsconform.storage import nvme
from dsconform.storage import tune as nvme_tune
from dsconform.storage import xcheck as nvme_xcheck

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (tmpfs on this machine), removed afterwards."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="dsconform-test-", dir="/dev/shm"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


# ---------------------------------------------------------------------------- mounts and paths

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684092k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 254:0 /srv /mnt/my\\040disk rw,relatime - ext4 /dev/vda rw
"""


def test_mountinfo_is_parsed_with_escapes():
    mounts = nvme.parse_mountinfo(MOUNTINFO)
    assert [m.fstype for m in mounts] == ["proc", "tmpfs", "ext4", "ext4"]
    assert mounts[3].mount_point == "/mnt/my disk" and mounts[3].device == (254, 0)
    assert mounts[1].options == ("rw", "relatime")


def test_mount_of_matches_device_and_longest_prefix(tmp_path):
    st = os.stat(tmp_path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    text = (f"1 0 {dev} / / rw - ext4 /dev/a rw\n"
            f"2 1 {dev} / {tmp_path.parent} rw - xfs /dev/a rw\n"
            f"3 1 999:9 / {tmp_path} rw - tmpfs none rw\n")  # another device: not this path's
    m = nvme.mount_of(tmp_path, nvme.parse_mountinfo(text))
    assert (m.fstype, m.mount_point) == ("xfs", str(tmp_path.parent))


def test_real_paths_name_their_filesystems(tmp_path, shm_dir):
    assert nvme.path_facts(shm_dir).fstype == "tmpfs"
    facts = nvme.path_facts(tmp_path)
    assert facts.fstype not in nvme.UNSUITABLE_FS and facts.free_bytes > 0
    assert "path" not in facts.params()  # records name the profile's path, not a temp dir


def test_tmpfs_path_fails_naming_it_and_nothing_is_written(shm_dir):
    with pytest.raises(nvme.NvmePathError) as err:
        nvme.check_path(shm_dir, MIB, where="profile.toml nvme.paths[1]")
    msg = str(err.value)
    assert msg.startswith("profile.toml nvme.paths[1]: ") and "is tmpfs, memory-backed" in msg
    assert "point the path at a directory on the NVMe device" in msg
    assert list(shm_dir.iterdir()) == []


def _mounted_as(monkeypatch, path, fstype: str, source: str, options: str = "rw") -> None:
    """Make ``path``'s filesystem read as ``fstype`` (a mountinfo line for its device)."""
    st = os.stat(path)
    text = (f"1 0 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / / rw - {fstype} {source} "
            f"{options}\n")
    real = nvme.mount_of
    monkeypatch.setattr(nvme, "mount_of", lambda p: real(p, nvme.parse_mountinfo(text)))


def test_overlay_path_fails_naming_it(tmp_path, monkeypatch):
    # A container's root; this machine has none to point at.
    _mounted_as(monkeypatch, tmp_path, "overlay", "overlay",
                "rw,lowerdir=/l,upperdir=/u,workdir=/w")
    with pytest.raises(nvme.NvmePathError, match=r"is overlay, a union filesystem .*bind mount"):
        nvme.check_path(tmp_path, MIB, where="w")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fstype, source, why", [
    ("zfs", "tank/nvme", "caches in its own ARC"),
    ("nfs4", "server:/export", "a network filesystem"),
    ("fuse.sshfs", "host:/dir", "a FUSE filesystem"),
    ("fuseblk", "/dev/nvme0n1p1", "a FUSE filesystem"),
])
def test_filesystems_that_cache_or_measure_elsewhere_fail(fstype, source, why, tmp_path,
                                                          monkeypatch):
    """ZFS's ARC is invisible to mincore (the read-back would be memory's); a network or FUSE
    filesystem measures a server or a daemon: none describes a local NVMe device."""
    _mounted_as(monkeypatch, tmp_path, fstype, source)
    with pytest.raises(nvme.NvmePathError, match=f"is {fstype}, {why}"):
        nvme.check_path(tmp_path, MIB, where="w")
    assert list(tmp_path.iterdir()) == []


def test_missing_path_fails_naming_entry(tmp_path):
    with pytest.raises(nvme.NvmePathError, match=r"^x\.toml nvme\.paths\[0\]: .*/nope: does "
                                                 r"not exist: create it"):
        nvme.check_path(tmp_path / "nope", MIB, where="x.toml nvme.paths[0]")
    assert not (tmp_path / "nope").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(nvme.NvmePathError, match="is not a directory"):
        nvme.check_path(tmp_path / "file", MIB, where="w")


def test_too_small_path_fails_with_both_numbers(tmp_path):
    free = nvme.path_facts(tmp_path).free_bytes
    with pytest.raises(nvme.NvmePathError) as err:
        nvme.check_path(tmp_path, free, where="w")
    assert f"the suite needs {free} bytes plus {nvme.RESERVE_BYTES}" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_read_only_path_fails(tmp_path, monkeypatch):
    # root writes anywhere on a writable mount; a read-only mount is what statvfs reports.
    real = os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)

        @property
        def f_flag(self):
            return self._st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real(p)))
    with pytest.raises(nvme.NvmePathError, match="is read-only for this user"):
        nvme.check_path(tmp_path, MIB, where="w")
    assert list(tmp_path.iterdir()) == []


def test_o_direct_probe_leaves_nothing(tmp_path):
    nvme.probe_o_direct(tmp_path, nvme.path_facts(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_owned_dir_is_removed_even_on_failure(tmp_path):
    with pytest.raises(RuntimeError), nvme.owned_dir(tmp_path) as d:
        (d / "file.bin").write_bytes(b"x" * 4096)
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    a, b = nvme.unique_file(tmp_path, "x"), nvme.unique_file(tmp_path, "x")
    assert a != b and a.parent == tmp_path and a.name.startswith(nvme.FILE_PREFIX)


def test_page_cache_residency_is_measured(tmp_path, shm_dir):
    for d in (tmp_path, shm_dir):
        f = d / "f.bin"
        with open(f, "wb") as fh:
            fh.write(os.urandom(4 * MIB))
            fh.flush()
            os.fsync(fh.fileno())
        assert nvme.resident_fraction(f) == 1.0  # just written through the cache
        nvme.drop_page_cache(f)
        # A disk's clean pages go; tmpfs pages cannot, they are the file.
        assert nvme.resident_fraction(f) == (1.0 if d == shm_dir else 0.0)
        f.unlink()


# ---------------------------------------------------------------------------- the aio block

DS_NVME_TUNE_OUTPUT = {"single_submit": "false", "overlap_events": "true", "num_threads": 8,
                       "queue_depth": 32, "block_size": 1048576}


def test_ds_nvme_tune_output_is_named_wrong():
    problems = nvme.aio_block_problems(DS_NVME_TUNE_OUTPUT)
    assert any("aio.num_threads: DeepSpeed's runtime does not read it" in p
               and "'intra_op_parallelism'" in p for p in problems)
    assert any("aio.single_submit: expected true or false, found 'false'" in p
               and "\"false\" included" in p for p in problems)
    # Why it matters: the runtime takes "false" for true and never sees num_threads.
    parsed = nvme.runtime_aio_config(DS_NVME_TUNE_OUTPUT)
    assert bool(parsed["single_submit"]) is True and parsed["intra_op_parallelism"] == 1


def test_aio_settings_block_has_runtime_keys_and_types():
    s = nvme.AioSettings(block_size=8 * MIB, queue_depth=128, intra_op_parallelism=4,
                         single_submit=True, overlap_events=False)
    assert s.block() == {"block_size": 8 * MIB, "queue_depth": 128, "intra_op_parallelism": 4,
                         "single_submit": True, "overlap_events": False, "use_gds": False}
    assert s.handle_args() == (8 * MIB, 128, True, False, 4)
    assert not nvme.aio_block_problems(s.block())
    with pytest.raises(ValueError, match=r"aio.single_submit: expected true or false"):
        nvme.AioSettings(single_submit="false")
    with pytest.raises(ValueError, match=r"aio.queue_depth: must be >= 1"):
        nvme.AioSettings(queue_depth=0)


def test_io_units_follow_threads_and_logical_blocks():
    facts = nvme.PathFacts("/x", "ext4", "/", "/dev/a", False, 1, 1, 512)
    assert nvme.io_units(nvme.AioSettings(intra_op_parallelism=3), facts) == (1536, 512)
    unknown = nvme.PathFacts("/x", "nfs", "/", "srv:/", False, 1, 1, 0)
    assert nvme.io_units(nvme.AioSettings(intra_op_parallelism=2), unknown) == (8192, 4096)


def test_ds_config_writes_zero_infinity_sections():
    cfg = ds_config(stage=3, dtype="fp32", optimizer="sgd", lr=0.1, micro_batch=2, grad_accum=1,
                    world_size=2, offload_optimizer=True, offload_param=True,
                    offload_device="nvme", nvme_path="/mnt/nvme/run", nvme_buffer_elements=4096)
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"]["device"] == z["offload_param"]["device"] == "nvme"
    assert z["offload_param"]["max_in_cpu"] == 0 and z["offload_param"]["buffer_size"] == 4096
    assert cfg["aio"] == nvme.AioSettings().block()
    base = dict(stage=3, dtype="fp32", optimizer="sgd", lr=0.1, micro_batch=2, grad_accum=1,
                world_size=2)
    for extra, message in (
            (dict(offload_device="nvme", nvme_path="/x"), "needs offload_optimizer=True"),
            (dict(offload_device="nvme", offload_optimizer=True), "needs an absolute directory"),
            (dict(nvme_path="/x"), "applies to offload_device='nvme' only"),
            (dict(offload_device="disk"), "must be 'cpu' or 'nvme'"),
            (dict(offload_device="nvme", offload_optimizer=True, nvme_path="/x",
                  aio={"num_threads": 8}), "must be a dsconform.storage.nvme.AioSettings")):
        with pytest.raises(ValueError, match=message):
            ds_config(**base, **extra)


def test_profile_accepts_gpu_floors_and_source_only_with_gpus():
    entry = {"path": "@scratch", "read_gbps": 1.0, "write_gbps": 1.0, "gpu_read_gbps": 0.5,
             "gpu_write_gbps": 0.5, "source": "measured"}
    p = from_data({"profile": {"name": "g"}, "gpus": {"count": 1}, "nvme": {"paths": [entry]}},
                  "g.toml")
    assert p.nvme_paths[0].gpu_read_gbps == 0.5 and p.nvme_paths[0].source == "measured"
    with pytest.raises(ProfileError, match=r"c.toml: nvme.paths\[0\].gpu_read_gbps: makes no "
                                           r"sense with gpus.count = 0"):
        from_data({"profile": {"name": "c"}, "gpus": {"count": 0}, "nvme": {"paths": [entry]}},
                  "c.toml")


# ---------------------------------------------------------------------------- fio and dd

FIO_JSON = """fio: some notice
{"jobs": [{"jobname": "x", "write": {"io_bytes": 67108864, "runtime": 79, "bw_bytes": 1},
 "read": {"io_bytes": 0, "runtime": 0}}]}"""
DD_ERR = ("64+0 records in\n64+0 records out\n"
          "67108864 bytes (67 MB, 64 MiB) copied, 0.112584 s, 596 MB/s\n")


def test_tool_outputs_are_parsed():
    assert nvme_xcheck.parse_fio(FIO_JSON, "write") == (67108864, 0.079)
    with pytest.raises(nvme_xcheck.ToolError, match="fio reports 0 bytes"):
        nvme_xcheck.parse_fio(FIO_JSON, "read")
    with pytest.raises(nvme_xcheck.ToolError, match="cannot read fio's JSON"):
        nvme_xcheck.parse_fio("garbage", "write")
    assert nvme_xcheck.parse_dd(DD_ERR) == (67108864, 0.112584)
    with pytest.raises(nvme_xcheck.ToolError, match="cannot read dd's summary"):
        nvme_xcheck.parse_dd("dd: error")


def test_fio_is_told_what_deepnvme_does(tmp_path):
    cmd = nvme_xcheck.fio_command(tmp_path / "f", "write", nbytes=64 * MIB, block_size=MIB,
                                  queue_depth=32)
    for option in ("--ioengine=libaio", "--direct=1", "--iodepth=32", f"--bs={MIB}",
                   "--fallocate=none", "--numjobs=1", f"--size={64 * MIB}"):
        assert option in cmd
    assert nvme_xcheck.dd_command(tmp_path / "f", "read", nbytes=4 * MIB, block_size=MIB)[-1] \
        == "iflag=direct"


@pytest.mark.parametrize("tool", ["fio", "dd"])
def test_tools_measure_a_real_file(tool, tmp_path):
    if nvme_xcheck.shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    f = tmp_path / "x.bin"
    w = nvme_xcheck.measure(tool, f, "write", nbytes=8 * MIB, block_size=MIB, queue_depth=8)
    r = nvme_xcheck.measure(tool, f, "read", nbytes=8 * MIB, block_size=MIB, queue_depth=8)
    assert w.nbytes == r.nbytes == 8 * MIB and w.gbps > 0 and r.gbps > 0
    assert f.stat().st_size == 8 * MIB
    with pytest.raises(nvme_xcheck.ToolError, match="exited 1"):  # a directory is no file
        nvme_xcheck.measure(tool, tmp_path, "read", nbytes=MIB, block_size=MIB, queue_depth=1)


# ---------------------------------------------------------------------------- the sweep

def test_sweep_order_covers_every_pair_first_and_every_cell_once():
    order = [s.block() for s in nvme_tune.sweep_order(nvme_tune.DEFAULT_GRID)]
    keys = list(nvme_tune.DEFAULT_GRID)
    cells = [{k: b[k] for k in keys} for b in order]
    assert len(order) == 64 and len({json.dumps(c, sort_keys=True) for c in cells}) == 64
    # The first configurations alone already try every pair of parameter values.
    first = next(n for n in range(1, 65)
                 if not uncovered_pairs(nvme_tune.DEFAULT_GRID, cells[:n]))
    assert first <= 12, first


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from dsconform.cli import main; "
                           "sys.exit(main())", "nvme-tune", *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_nvme_tune_refuses_bad_paths_with_exit_2(shm_dir, tmp_path):
    proc = _cli(str(shm_dir), "--seconds", "1")
    assert proc.returncode == 2 and "is tmpfs" in proc.stderr and proc.stdout == ""
    assert list(shm_dir.iterdir()) == []
    proc = _cli(str(tmp_path / "nope"))
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"dsconform nvme-tune: PATH: {tmp_path / 'nope'}: does not exist")  # said once
    proc = _cli(str(tmp_path), "--bytes", "12M", "--seconds", "1")
    assert proc.returncode == 2 and "12582912 bytes per transfer is not a multiple" in proc.stderr


@pytest.mark.skipif(_cuda(), reason="this machine has a CUDA GPU: the refusal cannot happen")
def test_nvme_tune_from_gpu_memory_without_a_gpu_is_one_line(tmp_path):
    proc = _cli(str(tmp_path), "--memory", "cuda", "--seconds", "1")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "dsconform nvme-tune: --memory cuda: torch sees no CUDA GPU here "
        "(torch.cuda.is_available() is False); use --memory locked"]


def test_nvme_tune_prints_only_the_block_on_stdout(tmp_path):
    """A short real sweep: progress on stderr, the runtime's aio block on stdout, no leftovers."""
    proc = _cli(str(tmp_path), "--seconds", "3", "--bytes", "8M")
    assert proc.returncode == 0, proc.stderr
    block = json.loads(proc.stdout)["aio"]
    assert not nvme.aio_block_problems(block)
    assert "nvme-tune: [1/64 " in proc.stderr and "best of " in proc.stderr
    assert list(tmp_path.iterdir()) == []
