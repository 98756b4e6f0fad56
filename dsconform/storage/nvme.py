"""DeepNVMe paths: what a directory is, whether the suite may write there, and the ``aio`` block.

Everything the DeepNVMe suite (suites/test_deepnvme.py) and ``dsconform nvme-tune`` decide before
they move a byte lives here, without torch or DeepSpeed imports:

- ``path_facts`` / ``check_path``: the filesystem behind a path (from /proc/self/mountinfo, matched
  by the path's device number), free space, read-only, the device's logical block size. A path
  that is missing, read-only, too small, or on a filesystem whose numbers would not be a disk's
  (tmpfs, overlay, ...) is a ``NvmePathError`` naming the path, the filesystem and the fix, raised
  before anything is written.
- ``owned_dir``: the one directory the suite writes into under a path (unique name, removed with
  everything in it on exit, also when a test fails).
- ``resident_fraction`` / ``drop_page_cache``: how caching is ruled out. DeepNVMe opens files with
  O_DIRECT (``open_file`` in csrc/aio/common/deepspeed_aio_common.cpp); the suite writes a fresh
  file every round, drops the file's pages (posix_fadvise DONTNEED) and checks with mincore(2) that
  none of its pages is in the page cache before timing a read. On tmpfs every page stays resident
  (measured: 4096 of 4096 after an O_DIRECT write), on ext4 none does (0 of 4096).
- ``AioSettings`` (dsconform/checks/aio.py): the handle's five parameters and the DeepSpeed
  ``aio`` config block with the keys and types the runtime reads
  (deepspeed/runtime/swap_tensor/aio_config.py).
  ``aio_block_problems`` names what ds_nvme_tune gets wrong: it emits ``num_threads`` and the
  strings "true"/"false"; the runtime reads ``intra_op_parallelism`` and takes any non-empty
  string, "false" included, as true.

Units: bytes and seconds; GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The aio block, a DeepSpeed config section, is the checks' (dsconform/checks/aio.py): its names
# are this module's too.
from dsconform.checks.aio import DS_NVME_TUNE_KEYS as DS_NVME_TUNE_KEYS
from dsconform.checks.aio import RUNTIME_AIO_TYPES as RUNTIME_AIO_TYPES
from dsconform.checks.aio import AioSettings as AioSettings
from dsconform.checks.aio import aio_block_problems as aio_block_problems
from dsconform.checks.aio import runtime_aio_config as runtime_aio_config
from dsconform.checks.aio import runtime_aio_defaults as runtime_aio_defaults

MIB = 1 << 20
# DeepSpeed's O_DIRECT_ALIGNMENT (csrc/aio/py_lib/deepspeed_py_io_handle.cpp): a handle's
# get_alignment() is intra_op_parallelism * 512.
SECTOR = 512
# Never fill a disk to its last byte: the suite needs what it writes plus this much left over.
RESERVE_BYTES = 64 * MIB
FILE_PREFIX = "dsconform-nvme-"

# Filesystems on which a DeepNVMe number would not describe a disk. tmpfs even accepts O_DIRECT
# since Linux 6.6 (this machine runs 6.18), so the handle "works" there and reports the speed of
# memory: the filesystem type must be checked, not only whether the I/O succeeds.
_MEMORY = ("memory-backed: every page lives in RAM, so the number is the speed of memory, not of "
           "a disk")
_UNION = ("a union filesystem (a container's root): O_DIRECT and libaio reach the disk only "
          "through the layer underneath, if at all; mount the NVMe directory into the container "
          "(a bind mount or volume) and point the path there")
UNSUITABLE_FS: dict[str, str] = {
    "tmpfs": _MEMORY, "ramfs": _MEMORY, "devtmpfs": _MEMORY, "hugetlbfs": _MEMORY,
    "overlay": _UNION, "aufs": _UNION, "unionfs": _UNION,
    "squashfs": "a read-only compressed image", "iso9660": "a read-only image",
    "proc": "a kernel interface, not storage", "sysfs": "a kernel interface, not storage",
}
# Filesystems whose caching the page-cache checks (mincore) cannot see, or whose number would
# describe a server: ZFS keeps data in its own ARC (and before 2.3 accepts O_DIRECT and ignores
# it), so a write and its read-back run at memory speed with nothing resident; a network or
# FUSE filesystem measures the network, the server or the daemon.
_OWN_CACHE = ("caches in its own ARC, which the suite's page-cache checks cannot see (and before "
              "ZFS 2.3 accepts O_DIRECT and ignores it): the read-back would measure memory")
_REMOTE = ("a network filesystem: the number would describe the network and the server, not a "
           "local NVMe device")
_FUSE = ("a FUSE filesystem: a user-space daemon (and its cache) sits between DeepNVMe and the "
         "disk")
UNSUITABLE_FS.update({"zfs": _OWN_CACHE, "nfs": _REMOTE, "nfs4": _REMOTE, "cifs": _REMOTE,
                      "smb3": _REMOTE, "9p": _REMOTE, "virtiofs": _REMOTE, "fuse": _FUSE,
                      "fuseblk": _FUSE})


def unsuitable(fstype: str) -> str | None:
    """Why a DeepNVMe number on ``fstype`` would not describe a local disk, or None."""
    if fstype.startswith("fuse."):  # fuse.sshfs, fuse.s3fs, ...
        return _FUSE
    return UNSUITABLE_FS.get(fstype)


class NvmePathError(RuntimeError):
    """A path the suite must not (or cannot) measure; the message names path, cause and fix."""


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    device: tuple[int, int]  # st_dev's (major, minor) as mountinfo writes it
    options: tuple[str, ...]


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[Mount]:
    """Entries of /proc/<pid>/mountinfo (proc(5)), in mount order."""
    mounts = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        fields, rest = left.split(), right.split()
        if len(fields) < 6 or len(rest) < 2:
            continue
        major, _, minor = fields[2].partition(":")
        mounts.append(Mount(mount_point=_unescape(fields[4]), fstype=rest[0],
                            source=_unescape(rest[1]), device=(int(major), int(minor)),
                            options=tuple(fields[5].split(","))))
    return mounts


def mount_of(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount | None:
    """The mount a path lives on: entries with the path's device number, the one whose mount point
    is the longest prefix of the resolved path (bind mounts share a device; the last mounted on
    the same point wins, as the kernel does)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    if mounts is None:
        try:
            mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        except OSError:
            return None
    best: Mount | None = None
    for m in mounts:
        inside = real == m.mount_point or real.startswith(m.mount_point.rstrip("/") + "/")
        if m.device == dev and inside and (best is None
                                           or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def logical_block_size(path: str | os.PathLike[str]) -> int:
    """The block device's logical block size in bytes (sysfs), 0 when there is no block device
    behind the path (tmpfs, overlay, NFS) or sysfs does not say."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for candidate in (base / "queue", base.parent / "queue"):  # a partition reads its disk's
        try:
            return int((candidate / "logical_block_size").read_text())
        except (OSError, ValueError):
            continue
    return 0


@dataclass(frozen=True)
class PathFacts:
    path: str
    fstype: str
    mount_point: str
    source: str
    read_only: bool
    free_bytes: int
    total_bytes: int
    logical_block_size: int  # 0: unknown

    def params(self) -> dict[str, Any]:
        """What a metric record carries about the filesystem it measured; not the directory
        itself, which may be a run's own temporary one (the caller names the profile's path)."""
        return {"fs": self.fstype, "mount": self.mount_point, "device": self.source,
                "logical_block_size": self.logical_block_size}

    def describe(self) -> str:
        return f"{self.path} ({self.fstype} on {self.source}, mounted at {self.mount_point})"


def path_facts(path: str | os.PathLike[str]) -> PathFacts:
    """What the suite needs to know about a directory; NvmePathError if it is no directory."""
    p = Path(path)
    if not p.exists():
        raise NvmePathError(f"{p}: does not exist")
    if not p.is_dir():
        raise NvmePathError(f"{p}: is not a directory")
    st = os.statvfs(p)
    mount = mount_of(p)
    return PathFacts(
        path=str(p), fstype=mount.fstype if mount else "unknown",
        mount_point=mount.mount_point if mount else "unknown",
        source=mount.source if mount else "unknown",
        read_only=bool(st.f_flag & os.ST_RDONLY) or not os.access(p, os.W_OK | os.X_OK),
        free_bytes=st.f_bavail * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize,
        logical_block_size=logical_block_size(p))


def check_path(path: str | os.PathLike[str], need_bytes: int, *, where: str) -> PathFacts:
    """Everything that makes a path unusable, found before one byte is written there.

    ``where`` names what the user must fix (e.g. "hardware_profiles/cpu-ci.toml nvme.paths[0]").
    Raises NvmePathError: missing, not a directory, read-only, a filesystem in UNSUITABLE_FS,
    less free space than ``need_bytes`` plus RESERVE_BYTES.
    """
    try:
        facts = path_facts(path)
    except NvmePathError as e:
        raise NvmePathError(f"{where}: {e}: create it on the NVMe device, or fix the path") \
            from None
    if facts.read_only:
        raise NvmePathError(f"{where}: {facts.describe()} is read-only for this user: the suite "
                            "writes its test files there; mount it read-write or fix the path")
    why = unsuitable(facts.fstype)
    if why:
        raise NvmePathError(f"{where}: {facts.describe()} is {facts.fstype}, "
                            f"{why}; point the path at a directory on the "
                            "NVMe device's own filesystem (ext4, xfs, ...)")
    need = need_bytes + RESERVE_BYTES
    if facts.free_bytes < need:
        raise NvmePathError(f"{where}: {facts.describe()} has {facts.free_bytes} bytes free, the "
                            f"suite needs {need_bytes} bytes plus {RESERVE_BYTES} to spare "
                            f"({need} bytes); free space there or lower the entry's bytes")
    return facts


def probe_o_direct(directory: str | os.PathLike[str], facts: PathFacts) -> None:
    """Write one aligned block with O_DIRECT, as DeepNVMe opens its files; NvmePathError naming
    the filesystem when the kernel refuses (EINVAL: no O_DIRECT there). The probe file is unique
    and removed."""
    block = max(facts.logical_block_size, 4096)
    probe = Path(directory) / f".{FILE_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    buf = mmap.mmap(-1, block)  # anonymous mappings are page-aligned, as O_DIRECT needs
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
    except OSError as e:
        raise NvmePathError(f"{facts.describe()}: O_DIRECT write refused ({e.strerror}): "
                            f"DeepNVMe opens every file with O_DIRECT, which {facts.fstype} does "
                            "not support here") from None
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


@contextlib.contextmanager
def owned_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh directory with a unique name under ``path``; it and everything in it is removed on
    exit, whatever happened inside. The only place under ``path`` the suite writes."""
    d = Path(tempfile.mkdtemp(prefix=FILE_PREFIX, dir=path))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def unique_file(directory: str | os.PathLike[str], label: str) -> Path:
    """A file name that exists nowhere yet: DeepNVMe opens for write without O_TRUNC, so an old
    file of the same name would keep its tail."""
    return Path(directory) / f"{FILE_PREFIX}{label}-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin"


# ---------------------------------------------------------------------------- the page cache

_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """The fraction of the file's pages that sit in the page cache (mincore(2) on a read-only
    mapping; mapping a file does not read it). 0.0 for an empty file."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop the file's clean pages (posix_fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def io_units(settings: AioSettings, facts: PathFacts) -> tuple[int, int]:
    """(size unit, offset unit) in bytes for I/O that DeepSpeed will not corrupt: each of the
    intra_op_parallelism threads moves size/intra_op_parallelism bytes from its own file offset,
    and O_DIRECT needs offsets and lengths in whole logical blocks (512 bytes unless the device
    says more; 4096 when no block device answers, which every device accepts)."""
    lbs = facts.logical_block_size or 4096
    lbs = max(lbs, SECTOR)
    return settings.intra_op_parallelism * lbs, lbs
