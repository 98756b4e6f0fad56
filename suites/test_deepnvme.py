"""DeepNVMe: DeepSpeed's asynchronous file I/O MUST move bytes exactly, as fast as the profile
promises, and MUST carry ZeRO-Infinity training to DDP's result.

- Integrity. An ``aio_handle`` (op async_io) MUST write and read back every byte exactly through
  each family of its API (sync_pwrite/sync_pread; async_pwrite/async_pread + wait;
  pwrite/pread with the async flag, both ways), with 1..N intra-op threads, from DeepNVMe's
  page-locked buffers, ordinary CPU tensors, torch-pinned tensors and GPU tensors, at file
  offsets and sizes that are not multiples of the block size (hypothesis draws them), with
  several operations outstanding before one wait. Its getters MUST return what it was built
  with. Where the profile promises op gds, a ``gds_handle``'s getters and GPU-memory registry
  (new_pinned_device_tensor, pin/unpin) MUST work; on a ``[[nvme.paths]]`` entry with ``gds =
  true`` it MUST also move GPU memory to and from files byte for byte, every API family. Every
  byte is checked twice: read back through the handle and read from the file with plain
  os.pread.
- Throughput. Every ``[[nvme.paths]]`` entry of the profile (``@scratch``: the run's --scratch)
  MUST write and read at its floors, from page-locked CPU memory (read_gbps/write_gbps) and, on
  GPU nodes, from GPU memory (gpu_read_gbps/gpu_write_gbps), at the entry's ``bytes``, median of
  3 rounds, GB/s = 1e9 bytes/s. Caching is ruled out: DeepNVMe opens files with O_DIRECT; every
  round writes a fresh file; its pages are dropped (posix_fadvise DONTNEED) and mincore(2) must
  find none in the page cache before the read is timed. A path on tmpfs, overlay or another
  filesystem whose number would not be a disk's, missing, read-only or without the free space
  FAILS naming the path, the filesystem and the fix, before anything is written.
- Cross-check. fio (libaio, O_DIRECT, same block size and queue depth, fresh file), else dd with
  O_DIRECT, measures the same path; the ratio is recorded, and DeepNVMe more than 5x above fio
  fails (its number did not come from the disk).
- Tuning. ``dsconform nvme-tune PATH`` sweeps block size, queue depth, intra-op parallelism,
  single_submit and overlap_events within a time budget, shows progress, and prints the best
  as the ``aio`` block the runtime reads (``intra_op_parallelism`` and real booleans, where
  ds_nvme_tune prints ``num_threads`` and "true"/"false").
- ZeRO-Infinity (NVME-ZINF-1): suites/test_zero_infinity.py.

DeepNVMe's native code runs in child processes only (a pooled one-rank process; GDS in a fresh
one each time): it aborts the process on misuse, and GDS calls exit() when cuFile refuses a file.
Files are written only inside a fresh directory of the test's own under the path, and removed.

Upstream: https://www.deepspeed.ai/tutorials/deepnvme/ ,
https://github.com/deepspeedai/DeepSpeed/tree/master/deepspeed/nvme (ds_io, ds_nvme_tune),
https://www.deepspeed.ai/docs/config-json/#asynchronous-io ,
https://www.deepspeed.ai/tutorials/zero/#offloading-to-cpu-and-nvme-with-zero-infinity

Stable ids: NVME-IO-1..4 (integrity, getters), NVME-GDS-1 (handle), NVME-GDS-2 (file I/O),
NVME-CFG-1, NVME-BW-1, NVME-XCHK-1, NVME-TUNE-1.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsconform.suite import (
    RankCall,
    RankError,
    batched,
    cell_results,
    compat,
    nvme,
    nvme_io,
    nvme_tune,
    nvme_xcheck,
    pairwise,
    requires,
    run_ranks,
)
from suites.deepnvme_paths import (
    KiB,
    MiB,
    accelerator_of,
    entry_label,
    generate_nvme_entries,
    scratch_dir,
    target,
)
from suites.deepnvme_ranks import (
    gds_device_tensors,
    gds_roundtrips,
    handle_getters,
    io_outstanding,
    io_roundtrip,
    io_throughput,
)

CAPABILITY = "deepnvme"
pytest_generate_tests = generate_nvme_entries  # one nvme_entry per profile path
# Per call. The first call of a fresh pool may build async_io or cpu_adam
# (docs/findings.md#op-builds); warm calls take milliseconds to seconds.
TIMEOUT_S = 900
ROUNDS = 3  # the recorder holds a floor to the median of at least 3 rounds
# The integrity matrix: small blocks and a short queue, so a transfer of a few MiB crosses many
# blocks and several submission windows per thread.
MATRIX_SETTINGS = dict(block_size=256 * KiB, queue_depth=4, single_submit=False,
                       overlap_events=True)
# Throughput and cross-check: what the ops suite and docs/findings.md#deepnvme measured with
# (1 MiB blocks, queue depth 32, one thread), so the profiles' floors compare with those
# numbers.
THROUGHPUT_SETTINGS = nvme.AioSettings(block_size=1 * MiB, queue_depth=32, intra_op_parallelism=1,
                                       single_submit=False, overlap_events=True)
# The cross-check compares two tools at one size; 256 MiB keeps it to seconds on a GPU node
# whose entry moves 1 GiB per round for its floors.
XCHECK_MAX_BYTES = 256 * MiB
NEEDS_AIO = requires(op="async_io")
NEEDS_GPU = [pytest.mark.gpu, requires(min_gpus=1)]


# ---------------------------------------------------------------------------- integrity

MODES = nvme_io.MODES
CPU_MEMORY = ("locked", "pageable")
GPU_MEMORY = ("pinned", "cuda")  # torch pins only with a CUDA device
INTRA_OP = (1, 2, 4)


def _memory_marks(memory: str) -> list:
    return NEEDS_GPU if memory in GPU_MEMORY else []


def _matrix_params() -> list:
    """Every CPU-memory cell in the default tier (cheap: milliseconds each); GPU-memory cells
    pairwise in the acceptance tier, the rest ``slow``."""
    gpu_tier = pairwise({"memory": GPU_MEMORY, "mode": MODES, "iop": INTRA_OP})
    params = []
    for memory, mode, iop in itertools.product(CPU_MEMORY + GPU_MEMORY, MODES, INTRA_OP):
        marks = _memory_marks(memory)
        if memory in GPU_MEMORY and {"memory": memory, "mode": mode, "iop": iop} not in gpu_tier:
            marks = marks + [pytest.mark.slow]
        params.append(pytest.param(memory, mode, iop, id=f"{memory}-{mode}-iop{iop}",
                                   marks=marks))
    return params


def _memories(node) -> tuple[str, ...]:
    return CPU_MEMORY + (GPU_MEMORY if node.gpu_count else ())


def _roundtrip_plan(params: dict, workdir: Path, run) -> tuple:
    """One NVME-IO-1 cell's rank call, in a directory checked before anything is written."""
    iop = params["iop"]
    settings = nvme.AioSettings(intra_op_parallelism=iop, **MATRIX_SETTINGS)
    stack = contextlib.ExitStack()
    d, facts = stack.enter_context(target(run.profile, None, None, run, workdir, 8 * MiB))
    size_unit, offset_unit = nvme.io_units(settings, facts)
    # 5 blocks and 3 units: crosses block and queue boundaries, ends mid-block.
    nbytes = (5 * settings.block_size // size_unit + 3) * size_unit
    return (RankCall(io_roundtrip, 1, TIMEOUT_S, args=(str(d), settings),
                     kwargs=dict(nbytes=nbytes, offset=3 * offset_unit, memory=params["memory"],
                                 mode=params["mode"], seed=iop),
                     accelerator=accelerator_of(run.node)), stack.close)


@NEEDS_AIO
@pytest.mark.anynode
@pytest.mark.parametrize("memory, mode, iop", _matrix_params())
# the cells run at once where lanes are on (dsconform.plugin.batch)
@batched(_roundtrip_plan)
def test_aio_api_roundtrip(memory, mode, iop, scratch, request):
    """NVME-IO-1: every aio_handle API family MUST write and read back every byte exactly."""
    cell_results(request, scratch)


@NEEDS_AIO
@pytest.mark.anynode
@given(data=st.data())
def test_aio_offsets_and_sizes(data, profile, run, node):
    """NVME-IO-2: any aligned size and file offset MUST round-trip byte-exactly."""
    compat.require(compat.AIO_HANDLE)  # an older handle aborts the process on some sizes
    settings = nvme.AioSettings(
        block_size=data.draw(st.sampled_from([4 * KiB, 64 * KiB, 1 * MiB]), label="block_size"),
        queue_depth=data.draw(st.sampled_from([1, 4, 32]), label="queue_depth"),
        intra_op_parallelism=data.draw(st.integers(1, 4), label="intra_op_parallelism"),
        single_submit=data.draw(st.booleans(), label="single_submit"),
        overlap_events=data.draw(st.booleans(), label="overlap_events"))
    # Drawn here, in the parent; the rank only executes the example.
    with scratch_dir(run) as (d, facts):
        size_unit, offset_unit = nvme.io_units(settings, facts)
        per_block = settings.block_size // size_unit
        # Arbitrary sizes, and sizes one unit either side of a block multiple: never the round
        # numbers DeepSpeed's own tests use.
        units = data.draw(st.one_of(
            st.integers(1, 2048),
            st.sampled_from([k * per_block + s for k in (1, 3) for s in (-1, 1)
                             if k * per_block + s >= 1])), label="size_units")
        offset = data.draw(st.integers(0, 64), label="offset_units") * offset_unit
        run_ranks(io_roundtrip, 1, timeout_s=TIMEOUT_S, accelerator=accelerator_of(node),
                  args=(str(d), settings),
                  kwargs=dict(nbytes=units * size_unit, offset=offset,
                              memory=data.draw(st.sampled_from(_memories(node)), label="memory"),
                              mode=data.draw(st.sampled_from(MODES), label="mode"),
                              seed=data.draw(st.integers(0, 2**31 - 1), label="seed")))


OUTSTANDING_SIZES = [n * 97 + 1 for n in range(8)]  # in I/O units: all different, none round


def _outstanding_plan(params: dict, workdir: Path, run) -> tuple:
    """One NVME-IO-3 cell's rank call, in a directory checked before anything is written."""
    settings = nvme.AioSettings(intra_op_parallelism=params["iop"], **MATRIX_SETTINGS)
    stack = contextlib.ExitStack()
    d, facts = stack.enter_context(target(run.profile, None, None, run, workdir, 16 * MiB))
    size_unit, _ = nvme.io_units(settings, facts)
    sizes = [n * size_unit for n in OUTSTANDING_SIZES]
    return (RankCall(io_outstanding, 1, TIMEOUT_S, args=(str(d), settings),
                     kwargs=dict(sizes=sizes, memory=params["memory"], seed=7),
                     accelerator=accelerator_of(run.node)), stack.close)


@NEEDS_AIO
@pytest.mark.anynode
@pytest.mark.parametrize("memory", [pytest.param(m, marks=_memory_marks(m))
                                    for m in CPU_MEMORY + GPU_MEMORY])
@pytest.mark.parametrize("iop", [1, 4], ids=lambda n: f"iop{n}")
@batched(_outstanding_plan)  # at once where lanes are on (dsconform.plugin.batch)
def test_outstanding_then_one_wait(memory, iop, scratch, request):
    """NVME-IO-3: eight operations outstanding MUST all complete at one wait(), byte-exact."""
    out = cell_results(request, scratch)
    assert out[0]["operations"] == len(OUTSTANDING_SIZES)


SETTINGS_STRATEGY = st.builds(
    nvme.AioSettings,
    block_size=st.sampled_from([4 * KiB, 128 * KiB, 1 * MiB, 8 * MiB]),
    queue_depth=st.sampled_from([1, 8, 32, 128]), intra_op_parallelism=st.integers(1, 8),
    single_submit=st.booleans(), overlap_events=st.booleans())


@NEEDS_AIO
@pytest.mark.anynode
@given(settings=SETTINGS_STRATEGY)
def test_aio_handle_getters(settings, run, node):
    """NVME-IO-4: an aio_handle's getters MUST return what it was built with."""
    with scratch_dir(run) as (d, _):
        out = run_ranks(handle_getters, 1, timeout_s=TIMEOUT_S, accelerator=accelerator_of(node),
                        args=(str(d), settings, "aio"))[0]
    assert not out["mismatches"], "; ".join(out["mismatches"])


def _gds_failed(what: str, e: RankError):
    pytest.fail(f"{what} failed in its own process (the run goes on): {e}\nGDS needs "
                "cuFile to accept the GPU memory and the file (nvidia-fs, or cuFile's "
                "compatibility mode, and a GDS-capable filesystem for I/O); its output is "
                "under 'Captured stderr'", pytrace=False)


def _gds_call(fn, what: str, **kwargs):
    """GDS in a fresh process; its death is a failure that says what and why, not a lost run."""
    try:
        return run_ranks(fn, 1, timeout_s=TIMEOUT_S, accelerator="cuda", reuse=False,
                         kwargs=kwargs)[0]
    except RankError as e:
        _gds_failed(what, e)


def _gds_handle_plan(params: dict, workdir: Path, run) -> RankCall:
    """NVME-GDS-1's call, in a fresh process of its own (GDS calls exit() when cuFile refuses):
    a batch runs it on a lane beside the other cells (a fresh process costs seconds)."""
    settings = nvme.AioSettings(block_size=1 * MiB, queue_depth=16, intra_op_parallelism=2,
                                single_submit=True, overlap_events=False)
    return RankCall(gds_device_tensors, 1, TIMEOUT_S, accelerator="cuda", fresh=True,
                    kwargs=dict(directory=str(workdir), settings=settings, nbytes=4 * MiB))


@pytest.mark.gpu
@pytest.mark.promised_ops_only
@requires(min_gpus=1, op="gds")
@batched(_gds_handle_plan)
def test_gds_handle_and_device_tensors(scratch, request):
    """NVME-GDS-1: a gds_handle's getters and GPU-memory registry (new/free, pin/unpin) MUST
    work. The acceptance tier checks it where the profile promises gds (auto: where nvidia-fs
    is loaded), the nightly tier wherever the op is compatible."""
    try:
        out = cell_results(request, scratch)[0]
    except RankError as e:
        _gds_failed("gds_handle with device tensors", e)
    assert not out["mismatches"], "; ".join(out["mismatches"])
    made = out["new_pinned_device_tensor"]
    assert made["device"].startswith("cuda") and made["numel"] == 4 * MiB, made
    assert out["usable"], "a tensor from new_pinned_device_tensor did not hold what was written"
    assert out["freed"] and out["pin"] and out["unpin"], out


# GDS file I/O: each API family, a sector-aligned and an unaligned size, at file offset 0 and
# past the first sector; GPU memory registered with cuFile.
GDS_CELLS = [{"nbytes": 4 * MiB, "offset": 0, "mode": "sync"},
             {"nbytes": 4 * MiB + 4096, "offset": 4096, "mode": "async"},
             {"nbytes": 1 * MiB + 512, "offset": 8192, "mode": "flag_async"},
             {"nbytes": 2 * MiB, "offset": 0, "mode": "flag_sync"}]


def _nvidia_fs() -> str:
    """Whether the nvidia-fs kernel driver (GDS's direct path) is loaded, for messages."""
    return ("loaded" if Path("/proc/driver/nvidia-fs").exists() else
            "not loaded (/proc/driver/nvidia-fs absent: cuFile can only use its compatibility "
            "mode)")


@pytest.mark.gpu
@requires(min_gpus=1, op="gds")
def test_gds_file_io_is_byte_exact(nvme_entry, profile, run, scratch):
    """NVME-GDS-2: on every ``[[nvme.paths]]`` entry with ``gds = true``, a gds_handle MUST
    write GPU memory to a file and read it back byte for byte through every API family (the
    file checked with a plain pread between the two). The op alone (``[deepspeed] ops``)
    promises that gds builds and hands out handles (NVME-GDS-1), not that cuFile accepts files:
    that is the path's promise."""
    index, entry = nvme_entry
    if not entry.gds:
        pytest.skip(f"{entry_label(profile, index, entry)} does not promise GDS file I/O (gds = "
                    f"false)")
    settings = nvme.AioSettings(block_size=1 * MiB, queue_depth=16, intra_op_parallelism=2,
                                single_submit=False, overlap_events=True)
    need = 2 * max(c["nbytes"] + c["offset"] for c in GDS_CELLS)
    with target(profile, index, entry, run, scratch, need) as (d, _):
        out = _gds_call(gds_roundtrips, f"gds_handle file I/O on {entry.path} (nvidia-fs "
                                        f"{_nvidia_fs()})", directory=str(d),
                        settings=settings, cells=GDS_CELLS, seed=11)
    assert [(r["nbytes"], r["offset"], r["mode"]) for r in out] == \
        [(c["nbytes"], c["offset"], c["mode"]) for c in GDS_CELLS], out


# ---------------------------------------------------------------------------- configuration

@pytest.mark.anynode
def test_aio_block_is_what_the_runtime_reads():
    """NVME-CFG-1: DeepSpeed's runtime MUST read the aio block the suite writes as written,
    with the defaults the suite assumes."""
    defaults = nvme.runtime_aio_defaults()
    assumed = nvme.AioSettings().block()
    assert defaults == assumed, (
        f"DeepSpeed's aio keys or defaults (deepspeed/runtime/swap_tensor/constants.py) are "
        f"{defaults}, dsconform.storage.nvme.AioSettings assumes {assumed}")
    tuned = nvme.AioSettings(block_size=8 * MiB, queue_depth=128, intra_op_parallelism=8,
                             single_submit=True, overlap_events=False)
    parsed = nvme.runtime_aio_config(tuned.block())
    assert parsed == tuned.block() and all(
        type(parsed[k]) is type(v) for k, v in tuned.block().items()), \
        f"the runtime read {parsed} from {tuned.block()}"


# ---------------------------------------------------------------------------- throughput

def _bytes_for(profile, index: int, entry, settings: nvme.AioSettings) -> int:
    if entry.bytes % settings.block_size:
        pytest.fail(f"{entry_label(profile, index, entry)}: bytes = {entry.bytes} must be a "
                    f"multiple of the {settings.block_size}-byte block the suite transfers in",
                    pytrace=False)
    return entry.bytes


def _throughput(profile, index, entry, run, node, scratch, memory: str, rounds: int,
                nbytes: int) -> tuple[dict, nvme.PathFacts, str]:
    """Timed rounds on one profile path; GPU memory on a gds = true path goes through GDS, in
    a fresh process."""
    kind = "gds" if memory == "cuda" and entry.gds else "aio"
    with target(profile, index, entry, run, scratch, nbytes) as (d, facts):
        kwargs = dict(directory=str(d), facts=facts, settings=THROUGHPUT_SETTINGS, nbytes=nbytes,
                      memory=memory, rounds=rounds, seed=index, kind=kind)
        if kind == "gds":
            out = _gds_call(io_throughput, f"GDS I/O on {entry.path}", **kwargs)
        else:
            out = run_ranks(io_throughput, 1, timeout_s=TIMEOUT_S,
                            accelerator=accelerator_of(node), kwargs=kwargs)[0]
    return out, facts, kind


@NEEDS_AIO
@pytest.mark.nvme
@pytest.mark.anynode
@pytest.mark.benchmark
@pytest.mark.parametrize("memory", [pytest.param("locked", id="cpu_locked"),
                                    pytest.param("cuda", id="gpu", marks=NEEDS_GPU)])
def test_throughput_floor(nvme_entry, memory, profile, run, node, scratch, metrics):
    """NVME-BW-1: every profile path MUST write and read at its floors (median of 3 rounds)."""
    index, entry = nvme_entry
    nbytes = _bytes_for(profile, index, entry, THROUGHPUT_SETTINGS)
    out, facts, kind = _throughput(profile, index, entry, run, node, scratch, memory, ROUNDS,
                                   nbytes)
    floors = ((entry.write_gbps, entry.read_gbps) if memory == "locked"
              else (entry.gpu_write_gbps, entry.gpu_read_gbps))
    params = dict(path=entry.path, memory=memory, kind=kind, bytes=entry.bytes, o_direct=True,
                  page_cache_resident_before_read=max(out["resident_before_read"]),
                  **facts.params(), **THROUGHPUT_SETTINGS.block())
    for op, floor in zip(("write", "read"), floors):
        metrics.record_rate(f"nvme.{op}", out[f"{op}_s"], amount=entry.bytes, unit="GB/s",
                            scale=1e9, floor=floor, **params)


@NEEDS_AIO
@pytest.mark.nvme
@pytest.mark.anynode
@pytest.mark.benchmark
def test_cross_check_with_second_tool(nvme_entry, profile, run, node, scratch, metrics):
    """NVME-XCHK-1: fio (else dd, O_DIRECT) MUST see the path within 5x of DeepNVMe."""
    index, entry = nvme_entry
    tool = nvme_xcheck.available_tool()
    if tool is None:
        pytest.fail("neither fio nor dd is installed: install fio (Debian: apt-get install fio)",
                    pytrace=False)
    s = THROUGHPUT_SETTINGS
    nbytes = min(_bytes_for(profile, index, entry, s), XCHECK_MAX_BYTES)
    out, facts, _ = _throughput(profile, index, entry, run, node, scratch, "locked", ROUNDS,
                                nbytes)
    tool_s: dict[str, list[float]] = {"write": [], "read": []}
    with target(profile, index, entry, run, scratch, nbytes) as (d, _):
        for i in range(ROUNDS):
            path = nvme.unique_file(d, f"{tool}{i}")
            try:
                for op in ("write", "read"):
                    try:
                        r = nvme_xcheck.measure(tool, path, op, nbytes=nbytes,
                                                block_size=s.block_size,
                                                queue_depth=s.queue_depth)
                    except nvme_xcheck.ToolError as e:
                        pytest.fail(f"{entry_label(profile, index, entry)}: {e}", pytrace=False)
                    tool_s[op].append(r.seconds)
            finally:
                path.unlink(missing_ok=True)
    params = dict(path=entry.path, tool=tool, bytes=nbytes, **facts.params(), **s.block())
    for op in ("write", "read"):
        metrics.record_rate(f"nvme.xcheck.{tool}.{op}", tool_s[op], amount=nbytes,
                            unit="GB/s", scale=1e9, **params)
        # DeepNVMe's rate over the tool's, round by round (rate ratio = inverse time ratio).
        ratios = [t / a for a, t in zip(out[f"{op}_s"], tool_s[op])]
        metrics.record(f"nvme.xcheck.{op}_ratio", ratios, unit="ratio", better="lower",
                       limit=nvme_xcheck.ratio_ceiling(tool), **params)


# ---------------------------------------------------------------------------- tuning

TUNE_BUDGET_S = 20.0


@NEEDS_AIO
@pytest.mark.nvme
@pytest.mark.slow
@pytest.mark.anynode
def test_tuning_sweep_emits_runtime_aio_block(nvme_entry, profile, run, scratch):
    """NVME-TUNE-1: `dsconform nvme-tune` MUST keep its time budget, show progress, and print an
    aio block DeepSpeed's runtime reads as written."""
    index, entry = nvme_entry
    grid_block = max(nvme_tune.DEFAULT_GRID["block_size"])
    nbytes = max(grid_block, min(entry.bytes, 256 * MiB) // grid_block * grid_block)
    with target(profile, index, entry, run, scratch, 2 * nbytes) as (d, _):
        cmd = [sys.executable, "-c", "import sys; from dsconform.cli import main; "
               "sys.exit(main())", "nvme-tune", str(d), "--seconds", str(TUNE_BUDGET_S),
               "--bytes", str(nbytes)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        wall = time.monotonic() - t0
        leftover = sorted(p.name for p in d.iterdir())
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}"
    assert not leftover, f"nvme-tune left {leftover} in {d}"
    trials = [ln for ln in proc.stderr.splitlines() if ln.startswith("nvme-tune: [")]
    assert len(trials) >= 2, f"expected a progress line per configuration:\n{proc.stderr}"
    # The budget holds the sweep (one trial may straddle it); building/loading the op and
    # starting Python come on top.
    summary = next(ln for ln in proc.stderr.splitlines() if "tried in" in ln)
    elapsed = float(summary.split("tried in ")[1].split(" s")[0])
    assert elapsed <= 2 * TUNE_BUDGET_S, f"the sweep took {elapsed} s of {TUNE_BUDGET_S} s"
    doc = json.loads(proc.stdout)
    assert list(doc) == ["aio"], f"stdout must hold only the aio block, got {proc.stdout!r}"
    block = doc["aio"]
    assert not nvme.aio_block_problems(block), nvme.aio_block_problems(block)
    parsed = nvme.runtime_aio_config(block)
    assert parsed == block and all(type(parsed[k]) is type(v) for k, v in block.items()), \
        f"DeepSpeed's runtime read {parsed} from the tuned block {block} (wall {wall:.0f} s)"
