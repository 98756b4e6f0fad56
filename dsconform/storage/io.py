"""DeepNVMe I/O through DeepSpeed's own handles: integrity round trips and timed rounds.

Used inside child processes only (the DeepNVMe suite's rank pool, ``dsconform nvme-tune``):
DeepSpeed's native I/O code aborts the process on some misuse (a C assert on a read past the end
of a file, ``exit()`` in the GDS op when cuFile refuses a file), and a test run must survive that.

Every call checks DeepSpeed's return codes (-1 when it could not open a file, which it only
prints), the size of what landed on disk, and the bytes themselves, read back twice: through the
handle and with a plain ``os.pread`` of the file, so that a write and a read that are wrong in
the same way (the wrong file offset on both) cannot agree with each other.

Memory kinds (``MEMORY``):
- ``locked``: ``handle.new_cpu_locked_tensor``, DeepNVMe's page-locked allocator (what ZeRO-
  Infinity's swappers use);
- ``pinned``: torch's ``pin_memory()`` (needs a CUDA device);
- ``pageable``: an ordinary CPU tensor (DeepNVMe copies through a page-locked bounce buffer);
- ``cuda``: a GPU tensor (aio: through a bounce buffer; gds: registered with cuFile, no copy).

Units: bytes and seconds; GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconform.base import compat
from dsconform.checks.op_io import first_mismatch
from dsconform.storage.nvme import (
    SECTOR,
    AioSettings,
    PathFacts,
    drop_page_cache,
    resident_fraction,
    unique_file,
)

MEMORY = ("locked", "pinned", "pageable", "cuda")
# How a test drives the handle: the three families of the API, each with its expected return.
MODES = ("sync", "async", "flag_async", "flag_sync")


class NvmeIOError(AssertionError):
    """DeepNVMe reported a failure or moved the wrong bytes; the message says which call, which
    file, and what was expected and found."""


def open_handle(settings: AioSettings, kind: str = "aio") -> Any:
    """A DeepSpeed aio_handle (op async_io) or gds_handle (op gds) built with ``settings``.

    Raises dsconform.ops.load.OpUnavailable when the op does not build or load; skips on a
    release whose handle is missing or can hang (dsconform/base/compat.py)."""
    from dsconform.ops.load import require_op
    if kind == "aio":
        compat.require(compat.AIO_WAIT)
    if kind not in ("aio", "gds"):
        raise ValueError(f"kind must be 'aio' or 'gds', not {kind!r}")
    module = require_op("gds" if kind == "gds" else "async_io").module
    cls = module.gds_handle if kind == "gds" else module.aio_handle
    return cls(*settings.handle_args())


def getters(handle: Any) -> dict[str, Any]:
    """What the handle says it was built with (a release without get_alignment skips)."""
    compat.require(compat.AIO_HANDLE)
    return {"block_size": handle.get_block_size(), "queue_depth": handle.get_queue_depth(),
            "single_submit": handle.get_single_submit(),
            "overlap_events": handle.get_overlap_events(),
            "intra_op_parallelism": handle.get_intra_op_parallelism(),
            "alignment": handle.get_alignment()}


def getter_mismatches(handle: Any, settings: AioSettings, kind: str = "aio") -> list[str]:
    """One line per getter that does not return what the handle was built with. The alignment
    of an aio handle is intra_op_parallelism * 512 (DeepSpeed's O_DIRECT_ALIGNMENT per thread);
    a gds handle hands its base class one thread, so only the five parameters are checked there."""
    found = getters(handle)
    expected: dict[str, Any] = {k: v for k, v in settings.block().items() if k != "use_gds"}
    if kind == "aio":
        expected["alignment"] = settings.intra_op_parallelism * SECTOR
    return [f"{kind}_handle.get_{k}() returned {found[k]!r}, built with {v!r}"
            for k, v in expected.items() if found[k] != v or type(found[k]) is not type(v)]


# ---------------------------------------------------------------------------- buffers

@dataclass
class Buffer:
    tensor: Any
    memory: str
    release: Callable[[], None] = lambda: None


def new_buffer(handle: Any, nbytes: int, memory: str, *, kind: str = "aio") -> Buffer:
    """``nbytes`` uint8 of the given memory kind; ``release()`` frees what DeepNVMe allocated.
    For kind="gds", ``cuda`` buffers are registered with cuFile (pin_device_tensor)."""
    import torch
    if memory not in MEMORY:
        raise ValueError(f"memory must be one of {MEMORY}, not {memory!r}")
    example = torch.empty(0, dtype=torch.uint8)
    if memory == "locked":
        t = handle.new_cpu_locked_tensor(nbytes, example)
        return Buffer(t, memory, lambda: handle.free_cpu_locked_tensor(t))
    if memory == "pinned":
        return Buffer(torch.empty(nbytes, dtype=torch.uint8).pin_memory(), memory)
    if memory == "pageable":
        return Buffer(torch.empty(nbytes, dtype=torch.uint8), memory)
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if kind == "gds":
        handle.pin_device_tensor(t)
        return Buffer(t, memory, lambda: handle.unpin_device_tensor(t))
    return Buffer(t, memory)


def fill_random(t: Any, seed: int) -> None:
    """Random bytes, generated on the GPU when there is one (1 GiB on one CPU core takes
    seconds)."""
    import torch
    dev = "cuda" if t.is_cuda or torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, device=dev, generator=gen))


def _sync(t: Any) -> None:
    # DeepNVMe's read copies the bounce buffer into a CUDA tensor with non_blocking=true.
    if t.is_cuda:
        import torch
        torch.cuda.synchronize(t.device)


# ---------------------------------------------------------------------------- calls

def _expect(call: str, rc: int, want: int, path: Path) -> None:
    if rc != want:
        raise NvmeIOError(f"{call} on {path} returned {rc}, expected {want} (DeepNVMe returns -1 "
                          "when it cannot open the file or the size does not divide by "
                          "intra_op_parallelism, and prints the reason to stderr)")


def _transfer(handle: Any, buf: Any, path: Path, offset: int, mode: str, op: str) -> None:
    """One ``op`` ("write" or "read") of ``buf`` at ``offset`` through one of the API's
    families (sync_p<op>, p<op>(async=False), async_p<op>, p<op>(async=True)); checks the
    return codes, and after an async call its wait()."""
    p, name = str(path), f"p{op}"
    if mode == "sync":
        _expect(f"sync_{name}", getattr(handle, f"sync_{name}")(buf, p, offset), 1, path)
    elif mode == "flag_sync":
        _expect(f"{name}(async=False)", getattr(handle, name)(buf, p, False, False, offset), 1,
                path)
    elif mode in ("async", "flag_async"):
        rc = (getattr(handle, f"async_{name}")(buf, p, offset) if mode == "async"
              else getattr(handle, name)(buf, p, False, True, offset))
        _expect(f"async_{name}" if mode == "async" else f"{name}(async=True)", rc, 0, path)
        _expect(f"wait() after one {op}", handle.wait(), 1, path)
    else:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")


def write(handle: Any, buf: Any, path: Path, offset: int, mode: str) -> None:
    """Write ``buf`` at ``offset`` through one of the API's families; checks return codes."""
    _transfer(handle, buf, path, offset, mode, "write")


def read(handle: Any, buf: Any, path: Path, offset: int, mode: str) -> None:
    """Read into ``buf`` from ``offset`` through one of the API's families."""
    _transfer(handle, buf, path, offset, mode, "read")
    _sync(buf)


def check_file(path: Path, expected: Any, offset: int, what: str) -> None:
    """The file holds ``expected`` at ``offset`` and ends right after it (read with plain
    os.pread, independent of DeepNVMe)."""
    import torch
    n = expected.numel()
    size = path.stat().st_size
    if size != offset + n:
        raise NvmeIOError(f"{what}: {path} has {size} bytes, expected {offset + n} "
                          f"({n} written at offset {offset})")
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    on_disk = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    want = expected.reshape(-1).cpu()
    if not torch.equal(on_disk, want):
        raise NvmeIOError(f"{what}: the file {path} does not hold what was written at offset "
                          f"{offset}: {first_mismatch(want, on_disk)}")


def flip_byte(path: Path, at: int) -> None:
    """Change one byte of a file in place (the red tests' tamper between write and read)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), at)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Roundtrip:
    """One write-then-read, byte-exact; what it was and how long it took."""
    nbytes: int
    offset: int
    memory: str
    mode: str
    settings: dict[str, Any]
    write_s: float
    read_s: float
    file: str


def roundtrip(handle: Any, settings: AioSettings, directory: Path, *, nbytes: int, offset: int,
              memory: str, mode: str, seed: int, kind: str = "aio",
              tamper: int | None = None) -> Roundtrip:
    """Write random bytes at ``offset`` of a fresh file, check the file with os.pread, read them
    back through the handle into a zeroed buffer of the same memory kind and compare every byte.
    ``tamper``: flip the byte at that file offset between the write and the read."""
    path = unique_file(directory, f"rt-{memory}-{mode}")
    src = new_buffer(handle, nbytes, memory, kind=kind)
    dst = new_buffer(handle, nbytes, memory, kind=kind)
    try:
        fill_random(src.tensor, seed)
        dst.tensor.zero_()
        _sync(src.tensor)
        what = (f"{kind} {mode} write of {nbytes} bytes from {memory} memory at offset {offset} "
                f"({settings.label()})")
        t0 = time.perf_counter()
        write(handle, src.tensor, path, offset, mode)
        write_s = time.perf_counter() - t0
        check_file(path, src.tensor, offset, what)
        if tamper is not None:
            flip_byte(path, tamper)
        t0 = time.perf_counter()
        read(handle, dst.tensor, path, offset, mode)
        read_s = time.perf_counter() - t0
        import torch
        if not torch.equal(src.tensor, dst.tensor):
            raise NvmeIOError(f"{kind} {mode} read of {nbytes} bytes into {memory} memory from "
                              f"offset {offset} of {path} returned other bytes than were written:"
                              f" {first_mismatch(src.tensor, dst.tensor)} ({settings.label()})")
    finally:
        src.release()
        dst.release()
        path.unlink(missing_ok=True)
    return Roundtrip(nbytes, offset, memory, mode, settings.block(), write_s, read_s, str(path))


def _all_outstanding(handle: Any, bufs: list, paths: list[Path], op: str) -> None:
    """Submit every ``op`` ("write" or "read") at once, alternating async_p<op> and
    p<op>(async=True), then one wait() that must count them all."""
    for i, (buf, path) in enumerate(zip(bufs, paths)):
        rc = (getattr(handle, f"async_p{op}")(buf, str(path), 0) if i % 2 == 0
              else getattr(handle, f"p{op}")(buf, str(path), False, True, 0))
        _expect(f"asynchronous {op} {i}", rc, 0, path)
    done = handle.wait()
    if done != len(bufs):
        raise NvmeIOError(f"one wait() after {len(bufs)} outstanding {op}s reported {done} "
                          "completed")


def outstanding(handle: Any, directory: Path, *, sizes: Sequence[int], memory: str,
                seed: int) -> dict[str, Any]:
    """Issue one asynchronous write per size (alternating async_pwrite and pwrite(async=True)),
    then ONE wait() that must report all of them; check every file; then the same for reads.
    A release whose handle never returns from that wait() skips (dsconform/base/compat.py)."""
    import torch
    compat.require(compat.AIO_HANDLE)
    paths = [unique_file(directory, f"many{i}") for i in range(len(sizes))]
    srcs = [new_buffer(handle, n, memory) for n in sizes]
    dsts = [new_buffer(handle, n, memory) for n in sizes]
    try:
        for i, b in enumerate(srcs):
            fill_random(b.tensor, seed + i)
            _sync(b.tensor)
        _all_outstanding(handle, [b.tensor for b in srcs], paths, "write")
        for i, (b, p) in enumerate(zip(srcs, paths)):
            check_file(p, b.tensor, 0, f"outstanding write {i} of {len(sizes)}")
        for b in dsts:
            b.tensor.zero_()
        _all_outstanding(handle, [b.tensor for b in dsts], paths, "read")
        for i, (s, d) in enumerate(zip(srcs, dsts)):
            _sync(d.tensor)
            if not torch.equal(s.tensor, d.tensor):
                raise NvmeIOError(f"outstanding read {i} of {len(sizes)} ({sizes[i]} bytes, "
                                  f"{memory} memory) returned other bytes than were written: "
                                  f"{first_mismatch(s.tensor, d.tensor)}")
    finally:
        for b in srcs + dsts:
            b.release()
        for p in paths:
            p.unlink(missing_ok=True)
    return {"operations": len(sizes), "sizes": list(sizes), "memory": memory}


# ---------------------------------------------------------------------------- timed rounds

@dataclass
class Rounds:
    """Seconds per round of a write of ``nbytes`` to a fresh file and of its read-back."""
    nbytes: int
    memory: str
    settings: dict[str, Any]
    write_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    # Page-cache residency of each file: right after the O_DIRECT write, and when the read began
    resident_after_write: list[float] = field(default_factory=list)
    resident_before_read: list[float] = field(default_factory=list)

    def gbps(self, op: str) -> list[float]:
        return [self.nbytes / s / 1e9 for s in getattr(self, f"{op}_s")]


def _uncached(path: Path, record: list[float], facts: PathFacts, what: str) -> None:
    """Append the share of ``path`` resident in the page cache to ``record``; any of it is an
    NvmeIOError saying ``what`` that means."""
    cached = resident_fraction(path)
    record.append(cached)
    if cached > 0:
        raise NvmeIOError(f"{facts.describe()}: {cached:.0%} of a file {what}")


def timed_rounds(handle: Any, settings: AioSettings, directory: Path, facts: PathFacts, *,
                 nbytes: int, memory: str, rounds: int, seed: int = 0, kind: str = "aio",
                 verify: bool = True,
                 progress: Callable[[str], None] | None = None) -> Rounds:
    """``rounds`` times: write ``nbytes`` from ``memory`` to a fresh file (sync_pwrite), make
    sure none of the file is in the page cache, read it back (sync_pread), compare, remove.

    Caching is ruled out four ways: DeepNVMe opens with O_DIRECT; mincore(2) must find none of
    the file resident right after the write (a write that went through the cache was timed at
    memory speed); the file is new each round (nothing of it was ever read through the cache);
    its pages are dropped (posix_fadvise) and mincore must find none resident before the read.
    A filesystem that keeps pages anyway (it ignored O_DIRECT) fails, naming it."""
    import torch
    out = Rounds(nbytes=nbytes, memory=memory, settings=settings.block())
    src = new_buffer(handle, nbytes, memory, kind=kind)
    dst = new_buffer(handle, nbytes, memory, kind=kind)
    try:
        fill_random(src.tensor, seed)
        _sync(src.tensor)
        for i in range(rounds):
            path = unique_file(directory, f"bw{i}")
            try:
                t0 = time.perf_counter()
                write(handle, src.tensor, path, 0, "sync")
                out.write_s.append(time.perf_counter() - t0)
                size = path.stat().st_size
                if size != nbytes:
                    raise NvmeIOError(f"sync_pwrite of {nbytes} bytes left {size} in {path}")
                _uncached(path, out.resident_after_write, facts,
                          "just written with O_DIRECT is in the page cache: the write went "
                          f"through the cache (the filesystem, {facts.fstype}, ignored "
                          "O_DIRECT), so its time would be memory's, not the disk's")
                drop_page_cache(path)
                _uncached(path, out.resident_before_read, facts,
                          "written with O_DIRECT is still in the page cache after "
                          "posix_fadvise(DONTNEED): the read would measure memory, not the "
                          f"disk ({facts.fstype} keeps the pages)")
                if verify:
                    dst.tensor.zero_()
                    _sync(dst.tensor)
                t0 = time.perf_counter()
                read(handle, dst.tensor, path, 0, "sync")
                out.read_s.append(time.perf_counter() - t0)
                if verify and not torch.equal(src.tensor, dst.tensor):
                    raise NvmeIOError(f"round {i}: {nbytes} bytes read back from {path} differ "
                                      f"from what was written: "
                                      f"{first_mismatch(src.tensor, dst.tensor)}")
            finally:
                path.unlink(missing_ok=True)
            if progress is not None:
                progress(f"round {i + 1}/{rounds}: write {nbytes / out.write_s[-1] / 1e9:.3g} "
                         f"GB/s, read {nbytes / out.read_s[-1] / 1e9:.3g} GB/s")
    finally:
        src.release()
        dst.release()
    return out
