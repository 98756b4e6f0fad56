"""The DeepNVMe suite's checks MUST go red, on DeepSpeed's real aio_handle and the real disk.

- DeepSpeed aborting its process (a read past the end of a file trips a C assert): that call
  fails naming the signal, the run and the next call go on;
- one byte of the file changed between DeepNVMe's write and its read: the round trip fails
  naming the byte (NVME-IO-1/2), in the suite's own rank code (suites/deepnvme_ranks.py);
- a handle compared with other settings than it was built with: the getters check names each
  one (NVME-IO-4);
- a file whose pages stay in the page cache (tmpfs, reached past the path check): the timed
  rounds refuse to time the read (NVME-BW-1's caching guard);
- the suite itself (suites/test_deepnvme.py, a pytest run in a subprocess) against a profile
  whose floor is far above the disk, whose second path is on tmpfs (/dev/shm) and whose third
  does not exist: the throughput test fails through the recorder naming metric, value, floor and
  path; the tmpfs and missing paths fail naming the filesystem and the entry; nothing is written
  on /dev/shm;
- ZeRO-Infinity whose tensors are too small for DeepSpeed to swap (width 53): the comparison
  with DDP passes, the NVMe-usage check fails (NVME-ZINF-1);
- the cross-check's ratio above its ceiling: the recorder fails it (NVME-XCHK-1).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import pytest

from dsconform.checks.equivalence import compare_rank_results
from dsconform.checks.tolerances import tolerance
from dsconform.checks.zero_vs_ddp import ZeroCase
from dsconform.harness.api import RankError, run_ranks
from dsconform.ops.cache import ensure_extensions_dir
from dsconform.results.records import MetricsRecorder
from dsconform.storage import io as nvme_io
from dsconform.storage import nvme
from dsconform.storage import xcheck as nvme_xcheck
from suites import deepnvme_ranks

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SETTINGS = nvme.AioSettings(block_size=256 << 10, queue_depth=4, intra_op_parallelism=2)


def _roundtrip(d: Path, tamper: int | None) -> dict:
    return run_ranks(deepnvme_ranks.io_roundtrip, 1, timeout_s=900, accelerator="cpu",
                     args=(str(d), SETTINGS),
                     kwargs=dict(nbytes=MIB + 3072, offset=4096, memory="locked", mode="async",
                                 seed=3, tamper=tamper))[0]


def _gds_available() -> str | None:
    """Why GDS round trips cannot run here (None: they can)."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (GDS moves GPU memory); runs on the GPU nodes"
    if not Path("/proc/driver/nvidia-fs").exists():
        # The lent H200 nodes (ext4 on virtio, no nvidia-fs): cuFileHandleRegister refuses the
        # file ('file descriptor is not registered') and DeepSpeed's op exits the process.
        return "needs GDS file I/O: nvidia-fs is not loaded here, cuFile refuses files"
    from deepspeed.ops.op_builder import GDSBuilder

    if not GDSBuilder().is_compatible(verbose=False):
        return "DeepSpeed's gds op is not compatible with this node"
    return None


def test_gds_round_trip_goes_red_when_a_byte_flips(tmp_path):
    """NVME-GDS-2's rank code: a file changed by one byte between the gds_handle's write and
    read MUST fail, naming the byte; the control passes. GPU nodes only."""
    why = _gds_available()
    if why:
        pytest.skip(why)
    cells = [{"nbytes": MIB + 512, "offset": 4096, "mode": "async"}]

    def call(tamper):
        return run_ranks(deepnvme_ranks.gds_roundtrips, 1, timeout_s=900, accelerator="cuda",
                         reuse=False, args=(str(tmp_path), SETTINGS),
                         kwargs=dict(cells=cells, seed=5, tamper=tamper))[0]

    assert call(None)[0]["nbytes"] == MIB + 512
    with pytest.raises(RankError) as err:
        call(4096 + 777)
    msg = str(err.value)
    assert "gds async read of 1049088 bytes into cuda memory from offset 4096" in msg, msg
    assert "first at offset 777" in msg, msg


def test_one_wrong_byte_on_read_fails_naming_it(tmp_path):
    """A file changed by one byte between DeepNVMe's write and read MUST fail the round trip."""
    assert _roundtrip(tmp_path, None)["nbytes"] == MIB + 3072  # the control
    with pytest.raises(RankError) as err:
        _roundtrip(tmp_path, 4096 + 5000)  # file offset: byte 5000 of the transfer
    msg = str(err.value)
    assert "aio async read of 1051648 bytes into locked memory from offset 4096" in msg
    assert "1 differing bytes of 1051648, first at offset 5000" in msg
    assert list(tmp_path.iterdir()) == []  # the rank removed its file on the way out


def read_past_end(directory: str) -> None:
    """Rank code: a read longer than the file, which DeepSpeed answers with a C assert."""
    import torch
    handle = nvme_io.open_handle(SETTINGS)
    path = Path(directory) / "short.bin"
    path.write_bytes(b"x" * 4096)
    handle.sync_pread(torch.empty(8192, dtype=torch.uint8), str(path))


def test_native_abort_fails_one_call_not_the_run(tmp_path):
    """DeepSpeed aborting its process MUST fail that call only: the next call works."""
    with pytest.raises(RankError) as err:
        run_ranks(read_past_end, 1, timeout_s=900, accelerator="cpu", args=(str(tmp_path),))
    assert "SIGABRT" in str(err.value), str(err.value)
    (tmp_path / "short.bin").unlink()
    assert _roundtrip(tmp_path, None)["nbytes"] == MIB + 3072  # a fresh process, working


def test_getters_name_every_mismatch():
    """A handle compared with other settings MUST be reported field by field."""
    ensure_extensions_dir()
    handle = nvme_io.open_handle(SETTINGS)
    assert nvme_io.getter_mismatches(handle, SETTINGS) == []
    other = nvme.AioSettings(block_size=SETTINGS.block_size, queue_depth=8,
                             intra_op_parallelism=4, single_submit=True,
                             overlap_events=SETTINGS.overlap_events)
    found = nvme_io.getter_mismatches(handle, other)
    assert found == ["aio_handle.get_queue_depth() returned 4, built with 8",
                     "aio_handle.get_intra_op_parallelism() returned 2, built with 4",
                     "aio_handle.get_single_submit() returned False, built with True",
                     "aio_handle.get_alignment() returned 1024, built with 2048"]


def test_cached_file_is_never_timed():
    """Rounds on a file the page cache keeps (tmpfs) MUST fail before the read is timed."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(prefix="dsconform-test-", dir="/dev/shm") as d:
        facts = nvme.path_facts(d)
        with pytest.raises(RankError) as err:
            run_ranks(deepnvme_ranks.io_throughput, 1, timeout_s=900, accelerator="cpu",
                      kwargs=dict(directory=d, facts=facts, settings=SETTINGS, nbytes=4 * MIB,
                                  memory="locked", rounds=3, seed=0))
        assert ("100% of a file just written with O_DIRECT is in the page cache: the write went "
                "through the cache (the filesystem, tmpfs, ignored O_DIRECT)") in str(err.value)
        assert list(Path(d).iterdir()) == []


PROFILE = """\
[profile]
name = "red-nvme"
[gpus]
count = 0
[deepspeed]
ops = ["async_io"]
[[nvme.paths]]
path = "@scratch"
read_gbps = 1000000.0
write_gbps = 1000000.0
bytes = 16777216
[[nvme.paths]]
path = "{shm}"
read_gbps = 0.001
write_gbps = 0.001
bytes = 16777216
[[nvme.paths]]
path = "{missing}"
read_gbps = 0.001
write_gbps = 0.001
bytes = 16777216
"""


def test_suite_fails_a_floor_far_above_the_disk_and_tmpfs_and_missing_paths(tmp_path):
    """The suite MUST fail each bad profile path, naming it, and write nothing there."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    scratch, results = tmp_path / "scratch", tmp_path / "results"
    scratch.mkdir()
    with tempfile.TemporaryDirectory(prefix="dsconform-test-", dir="/dev/shm") as shm:
        missing = tmp_path / "no-such-dir"
        prof = tmp_path / "red-nvme.toml"
        prof.write_text(PROFILE.format(shm=shm, missing=missing))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "suites/test_deepnvme.py", "-k",
             "test_throughput_floor and cpu_locked", "-p", "no:cacheprovider", "-p",
             "no:randomly", "--profile", str(prof), "--scratch", str(scratch), "--results",
             str(results)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert list(Path(shm).iterdir()) == [], "the suite wrote on the tmpfs path"
    assert not missing.exists(), "the suite created the missing path"
    assert proc.returncode == 1, proc.stdout[-3000:]
    # The failure messages in full (the summary keeps their first 300 characters).
    failed = {case.get("name"): case.find("failure").get("message")
              for case in ElementTree.parse(results / "junit.xml").iter("testcase")
              if case.find("failure") is not None}
    assert sorted(failed) == [f"test_throughput_floor[path{i}-cpu_locked]" for i in range(3)]
    floor = failed["test_throughput_floor[path0-cpu_locked]"]
    assert floor.startswith("Failed: recorded beyond its limit: nvme.write = ")
    assert "GB/s (median of 3 rounds: " in floor
    assert "is below its floor 1e+06 GB/s [path=@scratch, memory=locked, kind=aio" in floor
    assert "nvme.read = " in floor and "o_direct=True, page_cache_resident_before_read=0.0" in floor
    shm_out = failed["test_throughput_floor[path1-cpu_locked]"]
    assert f"{prof} nvme.paths[1] (path = '{shm}'): {shm} (tmpfs on tmpfs, mounted at " \
           f"/dev/shm) is tmpfs, memory-backed" in shm_out
    gone = failed["test_throughput_floor[path2-cpu_locked]"]
    assert f"nvme.paths[2] (path = '{missing}'): {missing}: does not exist" in gone
    # The scratch directory holds nothing of the run afterwards.
    assert list(scratch.iterdir()) == []


def test_zero_infinity_that_swaps_nothing_fails_the_nvme_check(tmp_path):
    """ZeRO-3 'offloaded to NVMe' with tensors below DeepSpeed's 1 MiB swap threshold MUST fail
    the NVMe-usage check even though it matches DDP."""
    case = ZeroCase(stage=3, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2,
                    offload_optimizer=True, offload_param=False, width=53, steps=3,
                    offload_device="nvme", nvme_path=str(tmp_path))
    results = run_ranks(deepnvme_ranks.train_zero_infinity, 2, args=(case,), accelerator="cpu",
                        timeout_s=900)
    compare_rank_results(results, tolerance("zero", "fp32", "sgd", accelerator="cpu"),
                         label=case.id).assert_ok()  # training itself is right
    problems = deepnvme_ranks.nvme_usage_problems(results, case, "the test's path")
    assert "rank 0: no optimizer swap file under the test's path" in problems
    assert "rank 1: no optimizer swap file under the test's path" in problems


@pytest.mark.parametrize("tool", ["fio", "dd"])
def test_cross_check_ratio_above_ceiling_fails(tool):
    """A DeepNVMe rate far above the tool's on the same path MUST fail through the recorder,
    whichever tool measured it (dd too: the 2xH200 node has no fio)."""
    rec = MetricsRecorder("t::t", "deepnvme", lambda m: None)
    rec.record("nvme.xcheck.read_ratio", [9.0, 11.0, 10.0], unit="ratio", better="lower",
               limit=nvme_xcheck.ratio_ceiling(tool), tool=tool, path="@scratch")
    [violation] = rec.violations()
    assert violation.startswith("nvme.xcheck.read_ratio = 10 ratio (median of 3 rounds: ")
    assert f"is beyond its ceiling 5 ratio [tool={tool}, path=@scratch]" in violation
    with pytest.raises(ValueError, match="fio' or 'dd'"):
        nvme_xcheck.ratio_ceiling("hdparm")
