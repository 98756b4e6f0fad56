"""What the checkpoint suite needs from the disk it writes to, and nothing else.

- ``preflight``: the checkpoint directory is writable and has room for the checkpoint, checked
  BEFORE anything is written, so a full or read-only scratch is one clear error naming the
  directory and the option to fix, never a half-written checkpoint and a torch traceback.
- A sha256 manifest in ``sha256sum`` format (``SHA256SUMS``, verifiable with ``sha256sum -c``):
  written right after a save, verified after the bytes were read back from the device. torch.save
  writes a CRC-32 per zip entry but torch.load does not check it (pytorch/pytorch#126952), so
  this is the only end-to-end proof that the node's storage returns the bytes it was given.
- ``drop_cached_pages``: fsync and drop a file's cached pages (the DeepNVMe suite's
  ``dsconform.storage.nvme.drop_page_cache``), so a read that follows (a verification, a timed load)
  comes from the device and not from memory.
- Deliberate damage for the corruption checks: truncate a file, flip one bit inside the tensor
  data of a torch.save file.

Units: bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsconform.storage.nvme import drop_page_cache

MANIFEST_NAME = "SHA256SUMS"
# A checkpoint needs its own size and the room the filesystem wants besides (metadata, a second
# tag written before the first is deleted): refuse below twice the estimate.
DEFAULT_HEADROOM = 2.0
_CHUNK = 1 << 22


class CheckpointStorageError(RuntimeError):
    """The checkpoint directory cannot take the checkpoint; the message names what to fix."""


@dataclass(frozen=True)
class Flip:
    """Where ``flip_tensor_byte`` changed a file: the zip entry and the absolute byte offset."""
    path: Path
    entry: str
    offset: int


def preflight(directory: Path, need_bytes: int, *, headroom: float = DEFAULT_HEADROOM,
              option: str = "--scratch") -> None:
    """Refuse a checkpoint directory that cannot take ``need_bytes``, before writing anything.

    Checks, in order: the directory (or its nearest existing parent, for one not created yet)
    is a directory; a file can be created there (a probe, removed at once); the free space is at
    least ``need_bytes * headroom``. Raises CheckpointStorageError naming the directory, the
    numbers and ``option``, the setting that chooses the directory.
    """
    if need_bytes < 0:
        raise ValueError(f"need_bytes must be >= 0, found {need_bytes}")
    directory = Path(directory)
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointStorageError(
            f"checkpoint directory {directory}: {existing} is not a directory; point {option} "
            f"at a writable directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".dsconform-probe-"):
            pass
    except OSError as e:
        raise CheckpointStorageError(
            f"checkpoint directory {directory}: cannot write in {existing} "
            f"({e.strerror or e}); point {option} at a writable directory") from None
    free = shutil.disk_usage(existing).free
    want = int(need_bytes * headroom)
    if free < want:
        raise CheckpointStorageError(
            f"checkpoint directory {directory}: {free / 1e9:.3g} GB free, the checkpoint needs "
            f"about {need_bytes / 1e9:.3g} GB ({headroom:g}x headroom: {want / 1e9:.3g} GB); "
            f"free space there or point {option} at a larger disk")


def checkpoint_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest, sorted (relative order stable)."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def total_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (what a save wrote, what a load reads)."""
    return sum(p.stat().st_size for p in checkpoint_files(root))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached_pages(paths: Iterable[Path]) -> None:
    """fsync each file, then drop its cached pages (``dsconform.storage.nvme.drop_page_cache``), so
    the
    next read goes to the device. Advice, not a guarantee: on tmpfs every page stays resident."""
    for path in paths:
        fsync_file(path)
        drop_page_cache(path)


def write_manifest(root: Path) -> Path:
    """Hash every file under ``root`` and write ``root/SHA256SUMS`` (sha256sum's format, paths
    relative to root). Each file is fsynced first, so the manifest describes bytes that reached
    the device; the manifest itself is fsynced too."""
    root = Path(root)
    lines = []
    for path in checkpoint_files(root):
        fsync_file(path)
        lines.append(f"{sha256_file(path)}  {path.relative_to(root).as_posix()}\n")
    manifest = root / MANIFEST_NAME
    with open(manifest, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(root: Path) -> dict[str, str]:
    """relative path -> sha256 from ``root/SHA256SUMS``; ValueError naming a malformed line."""
    manifest = Path(root) / MANIFEST_NAME
    entries: dict[str, str] = {}
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise ValueError(f"{manifest}:{number}: not a sha256sum line: {line!r}")
        entries[name] = digest
    return entries


def verify_manifest(root: Path) -> list[str]:
    """Re-read every file listed in ``root/SHA256SUMS`` and compare; one line per problem (a file
    missing, changed, or present but not listed). Empty: the storage returned every byte."""
    root = Path(root)
    expected = read_manifest(root)
    problems = []
    for name, digest in expected.items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: listed in {MANIFEST_NAME} but missing")
            continue
        found = sha256_file(path)
        if found != digest:
            problems.append(f"{name}: sha256 {found[:16]}... read back, {digest[:16]}... "
                            f"written ({path.stat().st_size} bytes)")
    for path in checkpoint_files(root):
        name = path.relative_to(root).as_posix()
        if name not in expected:
            problems.append(f"{name}: present but not in {MANIFEST_NAME}")
    return problems


def read_back_verdict(root: Path, problems: list[str], resident: float) -> tuple[str, str]:
    """What CKPT-STORE-1 concludes from ``verify_manifest``'s ``problems`` and the largest
    fraction of a file's pages still in memory after they were dropped: ("fail", why),
    ("skip", why) or ("pass", ""). Wrong bytes fail whatever the cache did; a read-back served
    (partly) from memory, tmpfs say, cannot vouch for a device: a skip that says so."""
    if problems:
        return "fail", (f"the storage under {root} returned other bytes than were written "
                        f"(sha256, {MANIFEST_NAME}):\n  " + "\n  ".join(problems))
    if resident > 0:
        return "skip", (f"the checkpoint under {root} read back as written, but {resident:.0%} "
                        f"of a file's pages stayed in memory after they were dropped (tmpfs?): "
                        f"the read-back did not reach a device. Give --scratch a directory on "
                        f"the storage checkpoints go to")
    return "pass", ""


def truncate(path: Path, keep: float = 0.5) -> int:
    """Cut ``path`` to ``keep`` of its size (at least one byte shorter); returns the new size."""
    size = Path(path).stat().st_size
    new = min(size - 1, int(size * keep))
    if new < 0:
        raise ValueError(f"{path}: empty file, nothing to truncate")
    os.truncate(path, new)
    return new


def _entry_data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start: after its local header (30 bytes, name, extra field)."""
    header = info.header_offset
    if raw[header:header + 4] != b"PK\x03\x04":
        raise ValueError(f"{info.filename}: no local file header at offset {header}")
    name_len, extra_len = struct.unpack("<HH", raw[header + 26:header + 30])
    return header + 30 + name_len + extra_len


def flip_tensor_byte(path: Path) -> Flip:
    """Flip the lowest bit of the middle byte of the largest tensor storage in a torch.save file
    (zip entry ``<archive>/data/<key>``), leaving the zip structure intact: a change only a
    checksum of the data can see. ValueError if the file holds no stored tensor data."""
    path = Path(path)
    with zipfile.ZipFile(path) as archive:
        storages = [i for i in archive.infolist()
                    if "/data/" in i.filename and i.file_size > 0
                    and i.compress_type == zipfile.ZIP_STORED]
    if not storages:
        raise ValueError(f"{path}: no uncompressed tensor storage (data/N entry) to flip")
    target = max(storages, key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    offset = _entry_data_offset(bytes(raw), target) + target.file_size // 2
    raw[offset] ^= 0x01
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([raw[offset]]))
        f.flush()
        os.fsync(f.fileno())
    return Flip(path=path, entry=target.filename, offset=offset)


def estimate_bytes(n_params: int, *, param_bytes: int, master_bytes: int = 4,
                   optimizer_states: int = 2) -> int:
    """What a ZeRO checkpoint of ``n_params`` parameters holds, about: the model weights
    (``param_bytes`` each), fp32 master weights (``master_bytes``, 0 when the weights are the
    masters) and ``optimizer_states`` fp32 tensors per parameter (Adam: 2), plus 1 MiB for
    pickled metadata and the zero_to_fp32.py scripts DeepSpeed writes beside it."""
    per_param = param_bytes + master_bytes + 4 * optimizer_states
    return n_params * per_param + (1 << 20)
