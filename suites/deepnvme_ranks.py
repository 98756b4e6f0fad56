"""Code that runs inside the child processes of suites/test_deepnvme.py.

The pytest process never calls DeepNVMe's native code itself: every function here is a run_ranks
entry point. The aio calls run in a pooled one-rank process (the op loads once; a native abort,
such as DeepSpeed's C assert on a read past the end of a file, fails one call and the pool is
replaced); GDS runs in a fresh process per call (reuse=False), since the GDS op calls exit() when
cuFile refuses a file. The parent decides every size, offset and setting (hypothesis draws there);
these functions only execute them and return plain data.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dsconform.suite import ZeroCase, compat, nvme, nvme_io, train_zero_and_ddp


@contextlib.contextmanager
def _cwd(directory: str) -> Iterator[None]:
    # DeepSpeed's gds_handle writes local_cufile.json into the current directory when the first
    # handle of a process is built (csrc/gds/py_lib/deepspeed_py_gds_handle.cpp): keep it under
    # the directory the test owns.
    old = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(old)


def io_roundtrip(directory: str, settings: nvme.AioSettings, *, nbytes: int, offset: int,
                 memory: str, mode: str, seed: int, tamper: int | None = None,
                 kind: str = "aio") -> dict[str, Any]:
    """One byte-exact write/read through an aio_handle, or a gds_handle with GPU memory
    (nvme_io.roundtrip)."""
    with _cwd(directory):
        handle = nvme_io.open_handle(settings, kind)
    result = nvme_io.roundtrip(handle, settings, Path(directory), nbytes=nbytes, offset=offset,
                               memory=memory, mode=mode, seed=seed, tamper=tamper, kind=kind)
    return asdict(result)


def gds_roundtrips(directory: str, settings: nvme.AioSettings, *, cells: list[dict[str, Any]],
                   seed: int, tamper: int | None = None) -> list[dict[str, Any]]:
    """Several byte-exact gds_handle round trips (GPU memory registered with cuFile; the file
    checked with a plain os.pread between the write and the read) in one fresh process, one per
    cell ({"nbytes", "offset", "mode"}). ``tamper``: flip that file byte before each read."""
    with _cwd(directory):
        handle = nvme_io.open_handle(settings, "gds")
    return [asdict(nvme_io.roundtrip(handle, settings, Path(directory), memory="cuda",
                                     seed=seed + i, tamper=tamper, kind="gds", **cell))
            for i, cell in enumerate(cells)]


def io_outstanding(directory: str, settings: nvme.AioSettings, *, sizes: list[int], memory: str,
                   seed: int) -> dict[str, Any]:
    """Several asynchronous operations outstanding, then one wait (nvme_io.outstanding)."""
    handle = nvme_io.open_handle(settings)
    return nvme_io.outstanding(handle, Path(directory), sizes=sizes, memory=memory, seed=seed)


def handle_getters(directory: str, settings: nvme.AioSettings, kind: str) -> dict[str, Any]:
    """What an aio_handle or gds_handle built with ``settings`` reports about itself."""
    with _cwd(directory):
        handle = nvme_io.open_handle(settings, kind)
    return {"found": nvme_io.getters(handle),
            "mismatches": nvme_io.getter_mismatches(handle, settings, kind)}


def io_throughput(directory: str, facts: nvme.PathFacts, settings: nvme.AioSettings, *,
                  nbytes: int, memory: str, rounds: int, seed: int,
                  kind: str = "aio") -> dict[str, Any]:
    """Timed rounds of write + read (nvme_io.timed_rounds); GDS ones in a fresh process."""
    with _cwd(directory):
        handle = nvme_io.open_handle(settings, kind)
    result = nvme_io.timed_rounds(handle, settings, Path(directory), facts, nbytes=nbytes,
                                  memory=memory, rounds=rounds, seed=seed, kind=kind)
    return asdict(result)


def gds_device_tensors(directory: str, settings: nvme.AioSettings, *,
                       nbytes: int) -> dict[str, Any]:
    """gds_handle's GPU-memory registry: new_pinned_device_tensor / free_pinned_device_tensor,
    and pin_device_tensor / unpin_device_tensor of a tensor torch allocated. No file I/O."""
    import torch
    with _cwd(directory):
        handle = nvme_io.open_handle(settings, "gds")
    example = torch.empty(0, dtype=torch.uint8)
    t = handle.new_pinned_device_tensor(nbytes, example)
    made = {"device": str(t.device), "numel": t.numel(), "dtype": str(t.dtype)}
    # Registered memory must still be ordinary CUDA memory to torch.
    t.fill_(7)
    torch.cuda.synchronize()
    filled = bool((t == 7).all())
    freed = handle.free_pinned_device_tensor(t)
    own = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    pinned, unpinned = handle.pin_device_tensor(own), handle.unpin_device_tensor(own)
    return {"new_pinned_device_tensor": made, "usable": filled, "freed": freed,
            "pin": pinned, "unpin": unpinned,
            "mismatches": nvme_io.getter_mismatches(handle, settings, "gds")}


# ---------------------------------------------------------------------------- ZeRO-Infinity

def _proc_io() -> dict[str, int] | None:
    """This process's storage I/O (proc(5) /proc/self/io); threads count, aio's included."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return None
    return {k.strip(): int(v) for k, v in (ln.split(":", 1) for ln in lines)}


def swap_evidence(engine: Any) -> dict[str, Any]:
    """What ZeRO-Infinity put on NVMe, read from the live engine (train_zero_and_ddp's inspect
    hook): the swap files under each offload section's nvme_path and how many parameter
    partitions live on NVMe."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    folders = {str(c.nvme_path) for c in (engine.zero_offload_optimizer(),
                                          engine.zero_offload_param())
               if c is not None and c.nvme_path is not None}
    files: dict[str, int] = {}
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                if name.endswith(".swp"):
                    full = os.path.join(root, name)
                    files[os.path.relpath(full, folder)] = os.path.getsize(full)
    params = list(engine.module.parameters())
    on_nvme = sum(1 for p in params
                  if getattr(getattr(p, "ds_tensor", None), "final_location", None)
                  == OffloadDeviceEnum.nvme)
    return {"swap_files": files, "params": len(params), "params_on_nvme": on_nvme}


def train_zero_infinity(case: ZeroCase) -> dict[str, Any]:
    """The ZeRO suite's ZeRO-vs-DDP run (train_zero_and_ddp) with the case's nvme
    offload, plus the evidence that NVMe was used: swap files and parameter placement from the
    engine, bytes this process read and wrote to storage while training. An older release's
    swapper aborts the process on its first write: it skips, naming the release."""
    compat.require(compat.AIO_HANDLE)
    before = _proc_io()
    result = train_zero_and_ddp(case, inspect=swap_evidence)
    after = _proc_io()
    io = None if before is None or after is None else {
        k: after[k] - before[k] for k in ("read_bytes", "write_bytes")}
    result["nvme"] = {**result["ds"].pop("inspected"), "proc_io": io}
    return result


def nvme_usage_problems(results: list[dict[str, Any]], case: ZeroCase,
                        where: str) -> list[str]:
    """Why the ranks' train_zero_infinity results do not show ZeRO-Infinity on NVMe (run in
    the parent): every rank needs optimizer swap files, parameter partitions on NVMe with their
    swap files when parameters are offloaded, and storage read and written while training."""
    problems = []
    for r in results:
        ev = r["nvme"]
        # relative to nvme_path: zero_stage_3/optimizer/rank0/..., zero_stage_3/<dtype>params/...
        opt_files = [f for f in ev["swap_files"] if f.split("/")[1:2] == ["optimizer"]]
        param_files = [f for f in ev["swap_files"] if f.split("/")[1:2] != ["optimizer"]]
        if not opt_files:
            problems.append(f"rank {r['rank']}: no optimizer swap file under {where}")
        if case.offload_param and not (ev["params_on_nvme"] and param_files):
            problems.append(f"rank {r['rank']}: {ev['params_on_nvme']} of {ev['params']} "
                            f"parameters live on NVMe, {len(param_files)} parameter swap files")
        io = ev["proc_io"]
        if io is not None and not (io["read_bytes"] > 0 and io["write_bytes"] > 0):
            problems.append(f"rank {r['rank']}: read {io['read_bytes']} and wrote "
                            f"{io['write_bytes']} bytes of storage while training")
    return problems
