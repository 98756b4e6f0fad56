"""A JIT-build lock left by a killed build must not hang the next run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dsconform.base import buildlock
from dsconform.base.buildlock import StaleBuildLock, clear_stale, scan


def _plant(ext, op="fused_adam", age_s=120.0):
    d = ext / op
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_planted_stale_lock_is_named_and_removed(tmp_path):
    lock = _plant(tmp_path)
    [found] = scan(tmp_path)
    assert found.stale and found.op == "fused_adam" and 115 < found.age_s < 200
    [line] = clear_stale(tmp_path, recheck_s=0)
    assert not lock.exists()
    assert str(lock) in line and "s old" in line and "no process holds it" in line


def test_the_lock_of_a_running_build_is_left_alone(tmp_path):
    lock = _plant(tmp_path, age_s=0)
    # A stand-in for torch's FileBaton holder: the descriptor stays open while it "builds".
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import os, time; fd = os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        [found] = scan(tmp_path)
        assert found.holders == (holder.pid,) and not found.stale
        assert clear_stale(tmp_path, recheck_s=0) == []
        assert lock.exists()
        assert f"a build of fused_adam is running (pid {holder.pid})" in found.describe()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_on_a_shared_file_system_is_reported_not_removed(tmp_path):
    lock = _plant(tmp_path)
    mounts = f"server:/export {tmp_path} nfs4 rw 0 0\n"
    with pytest.raises(StaleBuildLock) as err:
        clear_stale(tmp_path, recheck_s=0, mounts=mounts)
    msg = str(err.value)
    assert str(lock) in msg and "nfs4" in msg and f"rm {lock}" in msg and "s old" in msg
    assert lock.exists()


def test_mount_lookup_takes_the_longest_prefix(tmp_path):
    mounts = "/dev/vda / ext4 rw 0 0\nsrv:/x /mnt/shared nfs rw 0 0\n"
    assert buildlock._mount_fstype(tmp_path, mounts) == "ext4"
    assert buildlock._mount_fstype(tmp_path / "x", "srv:/x " + str(tmp_path) + " nfs rw 0 0\n"
                                   + mounts) == "nfs"


def test_ranks_start_despite_a_stale_shm_comm_lock(tmp_path, monkeypatch):
    """docs/findings.md#op-builds: a run killed during a JIT build left <op>/lock and every
    later rank on CPU waited in torch's FileBaton until the 300 s startup timeout, with no cause
    given. The lock is planted in the real extensions cache the ranks use; they must start
    within seconds."""
    from dsconform.harness import api as dist
    from dsconform.harness import pool
    from dsconform.ops.cache import ensure_extensions_dir
    from tests import rank_fns

    ext = ensure_extensions_dir()
    lock = _plant(ext, op="deepspeed_shm_comm")
    monkeypatch.setattr(pool, "STARTUP_TIMEOUT_S", 120.0)
    try:
        start = time.monotonic()
        out = dist.run_ranks(rank_fns.rank_and_sum, 2, timeout_s=60, accelerator="cpu",
                             reuse=False)
        assert [r["sum"] for r in out] == [3.0, 3.0]
        assert time.monotonic() - start < 100
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)
