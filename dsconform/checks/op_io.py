"""Functional checks of the I/O ops: async_io writes a buffer, reads it back and compares every
byte, with the rates (GB/s = 1e9 bytes/s); gds creates its handle. Each takes the op's loaded
module (dsconform.ops.load.require_op's ``module``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsconform.base import compat
from dsconform.checks.aio import AioSettings
from dsconform.units import GB


def first_mismatch(expected: Any, found: Any) -> str:
    """"N differing bytes of M, first at offset K (wrote X, read Y)"."""
    import torch
    a, b = expected.reshape(-1).cpu(), found.reshape(-1).cpu()
    diff = torch.nonzero(a != b).flatten()
    if diff.numel() == 0:
        return "no differing byte"
    i = int(diff[0])
    return (f"{diff.numel()} differing bytes of {a.numel()}, first at offset {i} "
            f"(wrote {int(a[i])}, read {int(b[i])})")


#: aio_handle / gds_handle's parameters for the checks (queue depth 32, else DeepSpeed's defaults).
SETTINGS = AioSettings(queue_depth=32)


def _check_aligned(op: str, handle: Any, nbytes: int) -> None:
    # Measured on DeepSpeed 0.19.8 (CPU, ext4-backed overlay): sync_pwrite of a size that is not a
    # multiple of the handle's alignment returns success but leaves the unaligned tail block out of
    # the file (4103 bytes -> 0, 1 MiB + 7 -> 1 MiB), and sync_pread of that size then aborts the
    # whole process (C assert in is_valid_bytes_to_read). Refuse such sizes instead.
    align = compat.aio_alignment(handle)
    if nbytes <= 0 or nbytes % align:
        raise ValueError(f"{op}: nbytes={nbytes} is not a positive multiple of the handle's "
                         f"alignment ({align} bytes); DeepSpeed silently drops an unaligned tail "
                         "on write and aborts on read")


def check_async_io(module: Any, scratch_dir: str | os.PathLike[str],
                   nbytes: int = 64 * 1024**2, *,
                   tamper: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """aio_handle: write random bytes from a page-locked CPU tensor to a file under scratch_dir,
    read them back into another, compare every byte; report GB/s (1e9 bytes/s). The file is removed.
    `tamper(path)` runs between write and read; tests use it to prove the comparison goes red."""
    import torch
    handle = module.aio_handle(*SETTINGS.handle_args())
    _check_aligned("async_io", handle, nbytes)
    path = Path(scratch_dir) / f"dsconform-aio-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    example = torch.empty(0, dtype=torch.uint8)
    wbuf = handle.new_cpu_locked_tensor(nbytes, example)
    rbuf = handle.new_cpu_locked_tensor(nbytes, example)
    try:
        wbuf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(0)))
        rbuf.zero_()
        t0 = time.perf_counter()
        handle.sync_pwrite(wbuf, str(path))
        write_s = time.perf_counter() - t0
        if (size := path.stat().st_size) != nbytes:
            raise AssertionError(f"wrote {nbytes} bytes to {path}, the file has {size}")
        if tamper is not None:  # tests prove the comparison goes red
            tamper(path)
        t0 = time.perf_counter()
        handle.sync_pread(rbuf, str(path))
        read_s = time.perf_counter() - t0
        if not torch.equal(wbuf, rbuf):
            raise AssertionError(f"async_io: data read back from {path} differs from what was "
                                 f"written: {first_mismatch(wbuf, rbuf)}")
    finally:
        handle.free_cpu_locked_tensor(wbuf)
        handle.free_cpu_locked_tensor(rbuf)
        path.unlink(missing_ok=True)
    return {"op": "async_io", "bytes": nbytes, "file_dir": str(scratch_dir),
            "block_size": SETTINGS.block_size, "queue_depth": SETTINGS.queue_depth,
            "intra_op_parallelism": SETTINGS.intra_op_parallelism,
            "write_s": write_s, "read_s": read_s, "write_gbps": nbytes / write_s / GB,
            "read_gbps": nbytes / read_s / GB, "gb": "1e9 bytes", "equal": True}


def check_gds(module: Any) -> dict[str, Any]:
    """gds_handle creation only. GDS file I/O needs a GDS-capable file system
    (docs/findings.md#deepnvme): it is checked through dsconform.storage.io on paths a profile
    marks gds = true."""
    module.gds_handle(*SETTINGS.handle_args())
    return {"op": "gds", "handle": True, "io": "not tried: handle only"}
