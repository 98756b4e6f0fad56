"""Stale JIT-build locks: a killed build must not hang the next run.

torch builds an extension under ``<TORCH_EXTENSIONS_DIR>/<op>/`` while holding the baton file
``lock`` (``torch.utils.file_baton.FileBaton``): it creates the file with O_EXCL and keeps it
open until the build ends, then removes it. A build killed in between (Ctrl-C, OOM, a job time
limit) leaves the file behind, and every later process that builds that op waits for it forever,
ranks on CPU included (DeepSpeed builds shm_comm inside init_distributed): the harness then
reported "startup timeout" after 300 s with no cause (docs/findings.md#op-builds).

A lock is *stale* when no process holds it open. The holder keeps its descriptor for the whole
build, so scanning ``/proc/*/fd`` proves it for this machine. A lock on a network file system
may belong to a build on another machine sharing the cache, and a process whose descriptors we
may not read (another user's) may hold it: then nothing can be proven, and the lock is reported,
never removed. Otherwise the stale lock is removed and the removal is reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# File systems another machine can share: a lock there may be held by a build elsewhere.
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
              "fuse.sshfs", "fuse.glusterfs", "glusterfs", "9p", "virtiofs", "fuse"}


@dataclass(frozen=True)
class BuildLock:
    path: Path
    age_s: float
    holders: tuple[int, ...]  # pids holding it open (a live build)
    provable: bool            # the scan could see every process, and the fs is local
    why_unprovable: str = ""

    @property
    def op(self) -> str:
        return self.path.parent.name

    @property
    def stale(self) -> bool:
        return not self.holders and self.provable

    def describe(self) -> str:
        age = f"{self.age_s:.0f} s old"
        if self.holders:
            return (f"{self.path} ({age}): a build of {self.op} is running "
                    f"(pid {', '.join(map(str, self.holders))})")
        if self.provable:
            return f"{self.path} ({age}): no process holds it; left by a build that was killed"
        return (f"{self.path} ({age}): held by no process visible here, but {self.why_unprovable}"
                f"; if no build of {self.op} is running anywhere, remove it: rm {self.path}")


def _mount_fstype(path: Path, mounts: str | None = None) -> str:
    """The file system type of the mount that holds ``path`` (longest matching mount point)."""
    try:
        text = mounts if mounts is not None else Path("/proc/mounts").read_text()
    except OSError:
        return "unknown"
    best, fstype = "", "unknown"
    target = str(path.resolve())
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
            best, fstype = mnt, parts[2]
    return fstype


def _open_holders(paths: set[str], proc: Path = Path("/proc")) -> tuple[dict[str, list[int]], int]:
    """{lock path: [pids holding it open]} and how many processes could not be inspected."""
    holders: dict[str, list[int]] = {p: [] for p in paths}
    hidden = 0
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            hidden += 1
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in holders:
                holders[target].append(int(pid_dir.name))
    return holders, hidden


def scan(ext_dir: Path, *, proc: Path = Path("/proc"), mounts: str | None = None,
         now: float | None = None) -> list[BuildLock]:
    """Every ``<ext_dir>/<op>/lock`` with its age and holders."""
    locks = sorted(Path(ext_dir).glob("*/lock")) if Path(ext_dir).is_dir() else []
    if not locks:
        return []
    now = time.time() if now is None else now
    holders, hidden = _open_holders({str(p.resolve()) for p in locks}, proc)
    fstype = _mount_fstype(Path(ext_dir), mounts)
    found = []
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # the build finished while we looked
        why = ""
        if fstype in NETWORK_FS or fstype.startswith("fuse."):
            why = f"the cache is on {fstype}, which other machines may share"
        elif hidden:
            why = f"{hidden} processes could not be inspected (not root?)"
        found.append(BuildLock(lock, age, tuple(holders.get(str(lock.resolve()), [])),
                               provable=not why, why_unprovable=why))
    return found


class StaleBuildLock(RuntimeError):
    """A lock that would make the next build of its op wait forever, and could not be removed."""


#: A lock that looks stale is looked at again after this long: torch closes the descriptor a
#: moment before it removes the file, and a build finishing in that moment must not be disturbed.
RECHECK_S = 0.5


def clear_stale(ext_dir: Path, *, recheck_s: float = RECHECK_S, **kw) -> list[str]:
    """Remove provably stale locks; raise StaleBuildLock for locks held by nobody visible that
    cannot be proven stale. Returns one line per lock removed. Locks of running builds stay."""
    removed, blocked = [], []
    candidates = [lk for lk in scan(ext_dir, **kw) if not lk.holders]
    if candidates and recheck_s:
        time.sleep(recheck_s)
        again = {lk.path: lk for lk in scan(ext_dir, **kw)}
        candidates = [again[lk.path] for lk in candidates
                      if lk.path in again and not again[lk.path].holders]
    for lock in candidates:
        if lock.stale:
            try:
                lock.path.unlink()
            except FileNotFoundError:
                continue
            removed.append(f"removed stale build lock {lock.describe()}")
        else:
            blocked.append(lock.describe())
    if blocked:
        raise StaleBuildLock(
            "a JIT-build lock may be stale; every build of its op would wait for it forever:\n  "
            + "\n  ".join(blocked))
    return removed
