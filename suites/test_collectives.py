"""Collectives and per-GPU health: collectives MUST be exact on every backend the node uses,
MUST reach the bus bandwidth floors the profile promises at the size each floor states, and no
GPU, link or rank of the node MUST lag its peers.

- Exactness (COLL-EXACT-0, COLL-EXACT-1, COLL-EXACT-2). all_reduce, all_gather, reduce_scatter,
  broadcast and all_to_all, called through ``deepspeed.comm`` the way ZeRO calls them
  (``all_reduce``, ``allgather_fn``, ``reduce_scatter_fn``, ``broadcast``,
  ``all_to_all_single``), and through torch.distributed beside it, MUST return exactly the
  expected result on known data, in fp32, bf16 and fp16, at the odd sizes 1, 53 and 65537
  elements (and 2**24 + 3 on GPUs; 2**20 + 3 on CPUs; COLL-EXACT-1) and at the aligned sizes 64,
  4096, 2**20 and 129 x 8 x the world size (and 2**24 on GPUs; COLL-EXACT-2), where kernels
  take their vectorised paths and a wrong tail hides from odd sizes. The sweep's timed calls are
  checked through both APIs too. The data of each dtype is exact in it,
  every partial sum too, and every value a rank receives is exact in no other type it could be
  carried in (bf16's past fp16's range, fp16's with more bits than bf16 keeps, fp32's with more
  than fp16 or a tf32-like mantissa keep), so a collective that carries fp32 in bf16 or fp16,
  fp16 in bf16, or bf16 in fp16, fails at every element. Odd sizes, not multiples of the world
  size, padded as ZeRO pads partitions, all_to_all with uneven splits
  (dsconform/checks/collectives.py).
  gloo (CI) and NCCL (GPUs) both run every collective in every dtype here.
- Bandwidth (COLL-BW-1, COLL-BW-2). Through torch.distributed, fp32, back-to-back calls, 3
  rounds per point, each point recorded as algbw and busbw (nccl-tests' formulas; GB/s = 1e9
  bytes/s): a sweep per collective from 1 MiB to the largest floor's size (else 4 GiB; 64 MiB on
  the CPU accelerator), a few sizes in the acceptance tier and every 4x step in the ``slow``
  tier; and one test per ``[[nccl.floors]]`` entry, where the recorder holds the median of the
  rounds to the floor at the floor's own size. Floors are measured the way they are checked
  (docs/findings.md#collectives: at 1 MiB torch.distributed reaches less than half of
  nccl-tests, so a floor from one tool does not transfer to the other at small sizes).
- Stragglers (COLL-STRAG-1, checked inside every COLL-BW point; COLL-P2P-1; GPU-MATMUL-1).
  Every rank's own time inside every collective is recorded; the time its peers wait for it
  MUST stay within ``[gpus] straggler_pct`` percent of the collective's time (held where a
  call takes at least 100 us: below, launch jitter is no evidence of a slow GPU). On
  multi-GPU nodes every ordered GPU pair's point-to-point bandwidth (the matrix, NCCL
  send/recv) and every GPU's dense bf16 and fp16 matmul TFLOPS MUST be within straggler_pct
  percent of the median of its peers, and the matmul MUST reach the profile's
  ``matmul_bf16_tflops`` / ``matmul_fp16_tflops`` floors (TFLOPS = 1e12 flop/s, 8192^3
  products), with no thermal or power-brake slowdown (NVML clock event reasons, read every
  20 ms while the matmul runs). GPU-MATMUL-2 (nightly): SUSTAIN_S of matmul on every GPU at
  once; the last quarter MUST run at least (100 - straggler_pct)% of the speed of the faster of
  the first two quarters,
  each window's median at the floor, no slowdown meanwhile (a GPU that throttles once hot).
  Failures name the GPU by nvidia-smi index and PCI bus id (dsconform/node/gpu_health.py). A node
  can meet every floor with one bad GPU; these catch it.
- Cross-check (COLL-XCHECK-1). Where nccl-tests' ``all_reduce_perf`` is on PATH, our all_reduce
  busbw MUST be at least 90% of its number at every all_reduce floor size; the ratio is
  recorded.

NCCL settings that change behaviour (NCCL_ALGO, NCCL_PROTO, NCCL_NVLS_ENABLE, NCCL_IB_*, ...)
are printed in the report header and stored in the results' machine_info.

Upstream: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md ,
https://deepspeed.readthedocs.io/en/latest/comm.html ,
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import pytest

from dsconform.suite import (
    ACCELERATORS,
    GB,
    TFLOPS,
    accel_cell,
    accel_params,
    collective_calls,
    collectives,
    gpu_health,
    nccl_tests,
    rendezvous_info,
    requires,
    run_ranks,
    run_state,
    worker_gpus,
)
from suites import collective_ranks

CAPABILITY = "collectives"
# A collective runs between ranks: its GPU cells skip on a node of one GPU, and say why.
pytestmark = requires(two_ranks="a collective runs between ranks")

EXACT_SIZES = {"cpu": (1, 53, 65537, (1 << 20) + 3), "cuda": (1, 53, 65537, (1 << 24) + 3)}
# COLL-EXACT-2: sizes that are multiples of 8 (and of 64), plus aligned_sizes()'s multiple of
# the world size; the CPU tier stops at 2**20 elements.
ALIGNED_SIZES = {"cpu": (64, 4096, 1 << 20), "cuda": (64, 4096, 1 << 20, 1 << 24)}
# Both APIs every exactness check goes through: deepspeed.comm first (what training calls).
EXACT_APIS = tuple(collective_calls.APIS)
P2P_BYTES, P2P_ITERS = 256 << 20, 20  # ~0.7 ms per transfer over NVLink
MATMUL_SIZE, MATMUL_ITERS = 8192, 50
#: COLL-XCHECK-1: torch.distributed may lose at most 10% to raw NCCL at a floor size
#: (docs/findings.md#collectives holds what the reference node measured).
MIN_RATIO_TO_NCCL_TESTS = 0.9
NCCL_TESTS_ITERS = 20  # all_reduce_perf's own default (-n)
TIMEOUT_S = 600  # per call: a full cuda sweep moves ~100 GB per collective


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "floor" not in metafunc.fixturenames:
        return
    prof = run_state(metafunc.config).profile
    params = []
    for fl in prof.nccl_floors:
        ws = fl.world_size or prof.gpus_promised
        params.append(pytest.param(
            fl, id=f"{fl.collective}-{fl.bytes}B-{ws}gpu",
            marks=[pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.benchmark,
                   requires(min_gpus=ws)]))
    if not params:  # say why instead of pytest's "got empty parameter set"
        params = [pytest.param(None, id="none", marks=pytest.mark.skip(
            reason=f"profile {prof.name} promises no nccl.floors"))]
    metafunc.parametrize("floor", params)


def _world(accel: str) -> int:
    """2 ranks on the CPU accelerator; on CUDA every GPU this run may use (the node's, or this
    xdist worker's slice of them)."""
    return 2 if accel == "cpu" else len(worker_gpus())


def _exact_params() -> list:
    """accel x collective x dtype; on GPUs bf16/fp16 cells are gated on the GPUs having them
    (the CPU accelerator's gloo moves and sums bf16/fp16 itself)."""
    out = []
    for accel in ACCELERATORS:
        for collective in collectives.COLLECTIVES:
            for dtype in collectives.DTYPES:
                gated = accel == "cuda" and dtype != "fp32"
                out.append(accel_cell(accel, collective, dtype, id=f"{collective}-{dtype}",
                                      world_size=2,
                                      marks=[requires(**{dtype: True})] if gated else []))
    return out


def _sweep_params() -> list:
    """accel x collective, each in the acceptance tier and in full (marked ``slow``)."""
    return [accel_cell(accel, collective, full, world_size=2, slow=full,
                       id=f"{collective}-full" if full else collective)
            for accel in ACCELERATORS
            for collective in collectives.COLLECTIVES
            for full in (False, True)]


# ------------------------------------------------------------------ exactness

@pytest.mark.parametrize("accel", accel_params(2))
def test_all_reduce_is_exact(accel):
    """COLL-EXACT-0: all_reduce of small integers MUST be exact on every rank (2 ranks)."""
    worst = run_ranks(collective_ranks.all_reduce_is_exact, 2, timeout_s=120,
                      args=(1 << 20,), accelerator=accel)
    # Every rank's own: max() would let a NaN on rank 1 through (NaN compares False).
    assert all(w == 0.0 for per_rank in worst for w in per_rank.values()), \
        f"all_reduce deviates from the exact sum by {worst} (per rank, by API)"


def aligned_sizes(accel: str, world_size: int) -> tuple[int, ...]:
    """COLL-EXACT-2's sizes: ALIGNED_SIZES and 129 x 8 x the world size (129: odd, so not a
    power of two)."""
    return (*ALIGNED_SIZES[accel], 129 * 8 * world_size)


def check_exact(collective: str, dtype: str, accel: str, world_size: int, node,
                perturb: dict[str, int] | None = None,
                sizes: tuple[int, ...] | None = None) -> list[collectives.Mismatch]:
    """Run the exactness check on the ranks through every API of EXACT_APIS, at ``sizes``
    (None: EXACT_SIZES); the mismatches, each naming its rank's device and API."""
    results = run_ranks(collective_calls.check_exact, world_size, timeout_s=TIMEOUT_S,
                        args=(collective, dtype, EXACT_SIZES[accel] if sizes is None else sizes),
                        kwargs={"perturb": perturb, "apis": EXACT_APIS}, accelerator=accel)
    ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
    found = collectives.mismatches_from_ranks([r["mismatches"] for r in results])
    return [dataclasses.replace(m, where=ids[m.rank].label) for m in found]


@pytest.mark.parametrize("accel, collective, dtype", _exact_params())
def test_collective_is_exact(accel: str, collective: str, dtype: str, node):
    """COLL-EXACT-1: every collective through deepspeed.comm MUST return the exact result."""
    mismatches = check_exact(collective, dtype, accel, _world(accel), node)
    assert not mismatches, collectives.exactness_message(mismatches)


@pytest.mark.parametrize("accel, collective, dtype", _exact_params())
def test_collective_is_exact_at_aligned_sizes(accel: str, collective: str, dtype: str, node):
    """COLL-EXACT-2: every collective MUST be exact at sizes that are multiples of 8, too."""
    n = _world(accel)
    mismatches = check_exact(collective, dtype, accel, n, node, sizes=aligned_sizes(accel, n))
    assert not mismatches, collectives.exactness_message(mismatches)


# ------------------------------------------------------------------ bandwidth and stragglers

def record_point(metrics, collective: str, point: dict[str, Any],
                 ids: list[gpu_health.GpuIdentity], straggler_pct: float,
                 floor: float | None = None, **params: Any) -> None:
    """Record one measured size: busbw (held to ``floor`` by the recorder, if given), algbw,
    and per rank its time inside the calls and how long its peers waited for it (held to
    ``straggler_pct`` by the recorder, naming the rank's GPU and bus id, where a call takes at
    least gpu_health.MIN_WAIT_CHECK_SECONDS and the wait at least MIN_WAIT_SECONDS); then fail
    if any rank's checked call after the timed ones returned a wrong element."""
    n = len(ids)
    nbytes, seconds = point["bytes"], point["seconds"]
    factor = collectives.bus_factor(collective, n)
    metrics.record_rate(f"{collective}.busbw", seconds, amount=nbytes * factor, unit="GB/s",
                        scale=GB, floor=floor, **params)
    metrics.record_rate(f"{collective}.algbw", seconds, amount=nbytes, unit="GB/s", scale=GB,
                        **params)
    inside = point["inside"]  # [rank][round]
    waited = [gpu_health.waited_for_pct([inside[r][k] for r in range(n)], seconds[k])
              for k in range(len(seconds))]  # [round][rank]
    long_enough = statistics.median(seconds) >= gpu_health.MIN_WAIT_CHECK_SECONDS
    for r, ident in enumerate(ids):
        where = {"who": ident.label, **params, **ident.params()}
        metrics.record(f"{collective}.rank_seconds", inside[r], unit="s", better="lower",
                       **where)
        wait_s = statistics.median(w[r] / 100 * s for w, s in zip(waited, seconds))
        held = long_enough and wait_s >= gpu_health.MIN_WAIT_SECONDS
        metrics.record(f"{collective}.waited_for_pct", [w[r] for w in waited], unit="%",
                       better="lower", limit=straggler_pct if held else None, **where)
    # The timed collective at the timed size, checked once on known data: a fast but wrong
    # collective (part of the work at large sizes) must not pass its floor. The same call
    # through deepspeed.comm, too.
    who = [ident.label for ident in ids]
    wrong = [collectives.wrong_output_message(collective, nbytes, point[key], who, api=api)
             for key, api in (("wrong", "torch.distributed"), ("wrong_ds", "deepspeed.comm"))]
    assert not any(wrong), "; ".join(w for w in wrong if w)


@pytest.mark.benchmark
@pytest.mark.parametrize("accel, collective, full", _sweep_params())
def test_bandwidth_sweep(accel: str, collective: str, full: bool, node, profile, metrics):
    """COLL-BW-1: each collective's sweep MUST measure every size, no rank holding up the rest."""
    n = _world(accel)
    top = collectives.sweep_top(profile.nccl_floors, accel)
    sizes = collectives.sweep_sizes(collective, top, accelerator=accel, full=full)
    points = [(s, collectives.iterations(s, accel)) for s in sizes]
    result = run_ranks(collective_calls.measure, n, timeout_s=TIMEOUT_S,
                       args=(collective, points), accelerator=accel)[0]
    ids = gpu_health.identify(result["identities"], node.hardware.bus_ids)
    pct = gpu_health.straggler_pct(profile.straggler_pct)
    for point in result["points"]:
        record_point(metrics, collective, point, ids, pct, bytes=point["bytes"], world_size=n,
                     dtype="fp32", accelerator=accel, iters=point["iters"])


def test_busbw_floor(floor, node, profile, metrics):
    """COLL-BW-2: bus bandwidth MUST reach the profile's floor for that collective and size."""
    ws = floor.world_size or profile.gpus_promised
    iters = collectives.iterations(floor.bytes, "cuda")
    result = run_ranks(collective_calls.measure, ws, timeout_s=TIMEOUT_S,
                       args=(floor.collective, [(floor.bytes, iters)]), accelerator="cuda")[0]
    ids = gpu_health.identify(result["identities"], node.hardware.bus_ids)
    # busbw = bytes * bus factor / time (nccl-tests); the recorder holds the median of 3 rounds
    # to the floor and names collective, size and world size when it is missed.
    record_point(metrics, floor.collective, result["points"][0], ids,
                 gpu_health.straggler_pct(profile.straggler_pct), floor=floor.busbw_gbps,
                 bytes=floor.bytes, world_size=ws, iters=iters, source=floor.source or "profile")


def record_links(metrics, result: dict[str, Any], ids: list[gpu_health.GpuIdentity],
                 straggler_pct: float, **params: Any) -> None:
    """Each link's bandwidth, and its percentage of the other links' median, held to
    100 - straggler_pct by the recorder (naming both ends)."""
    links = result["links"]
    rounds = len(links[0]["seconds"])
    gbps = [[result["bytes"] / GB / link["seconds"][k] for link in links] for k in range(rounds)]
    pct = [gpu_health.pct_of_peer_median(row) for row in gbps] if len(links) > 1 else None
    for i, link in enumerate(links):
        src, dst = ids[link["src"]], ids[link["dst"]]
        where = {"link": f"{src.label} -> {dst.label}", **params, **src.params("src_"),
                 **dst.params("dst_")}
        metrics.record_rate("p2p.bandwidth", link["seconds"], amount=result["bytes"],
                            unit="GB/s", scale=GB, iters=result["iters"], **where)
        if pct is not None:
            metrics.record("p2p.pct_of_peer_median", [row[i] for row in pct], unit="%",
                           better="higher", limit=100.0 - straggler_pct, **where)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.benchmark
@requires(min_gpus=2)
def test_pairwise_bandwidth(node, profile, metrics):
    """COLL-P2P-1: no GPU-to-GPU link MUST be slower than straggler_pct below its peers."""
    n = _world("cuda")
    result = run_ranks(collective_ranks.measure_pairs, n, timeout_s=TIMEOUT_S,
                       args=(P2P_BYTES, P2P_ITERS), accelerator="cuda")[0]
    ids = gpu_health.identify(result["identities"], node.hardware.bus_ids)
    for link in result["links"]:  # the matrix, in the captured output of a failure
        gbps = statistics.median(result["bytes"] / GB / s for s in link["seconds"])
        print(f"{ids[link['src']].label} -> {ids[link['dst']].label}: {gbps:.1f} GB/s")
    record_links(metrics, result, ids, gpu_health.straggler_pct(profile.straggler_pct),
                 world_size=n, accelerator="cuda")


def record_matmul(metrics, dtype: str, results: list[dict[str, Any]],
                  ids: list[gpu_health.GpuIdentity], floor: float | None,
                  straggler_pct: float, **params: Any) -> None:
    """Each GPU's TFLOPS (held to ``floor``) and its percentage of the other GPUs' median
    (held to 100 - straggler_pct), both by the recorder, naming the GPU."""
    size = results[0]["size"]
    flops = gpu_health.matmul_flops(size, size, size)
    rounds = len(results[0]["seconds"])
    rates = [[flops / r["seconds"][k] for r in results] for k in range(rounds)]
    pct = [gpu_health.pct_of_peer_median(row) for row in rates] if len(results) > 1 else None
    for i, (res, ident) in enumerate(zip(results, ids)):
        where = {"who": ident.label, **params, **ident.params(), "m": size, "n": size,
                 "k": size, "iters": res["iters"]}
        metrics.record_rate(f"matmul.{dtype}", res["seconds"], amount=flops, unit="TFLOPS",
                            scale=TFLOPS, floor=floor, **where)
        if pct is not None:
            metrics.record(f"matmul.{dtype}.pct_of_peer_median", [row[i] for row in pct],
                           unit="%", better="higher", limit=100.0 - straggler_pct, **where)


def _matmul_on_every_gpu(fn: Any, dtype: str, node, profile, amount: float
                         ) -> tuple[int, list[dict[str, Any]], list[gpu_health.GpuIdentity],
                                    float | None]:
    """``fn(dtype, MATMUL_SIZE, amount)`` on every GPU at once: (world size, the ranks'
    results, who each rank ran on, the profile's TFLOPS floor for ``dtype``)."""
    n = _world("cuda")
    results = run_ranks(fn, n, timeout_s=TIMEOUT_S, args=(dtype, MATMUL_SIZE, amount),
                        accelerator="cuda")
    ids = gpu_health.identify([r["identity"] for r in results], node.hardware.bus_ids)
    floor = {"bf16": profile.matmul_bf16_tflops, "fp16": profile.matmul_fp16_tflops}[dtype]
    return n, results, ids, floor


@pytest.mark.gpu
@pytest.mark.benchmark
@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=requires(min_gpus=1, bf16=True)),
                                   pytest.param("fp16", marks=requires(min_gpus=1, fp16=True))])
def test_matmul_tflops(dtype: str, node, profile, metrics):
    """GPU-MATMUL-1: every GPU's dense matmul MUST reach the floor and its peers' speed."""
    n, results, ids, floor = _matmul_on_every_gpu(collective_ranks.matmul_seconds, dtype, node,
                                                  profile, MATMUL_ITERS)
    record_matmul(metrics, dtype, results, ids, floor,
                  gpu_health.straggler_pct(profile.straggler_pct), world_size=n)
    _no_slowdown(results, ids, f"the {dtype} matmul")


def _no_slowdown(results: list[dict[str, Any]], ids: list[gpu_health.GpuIdentity],
                 what: str) -> None:
    """The clock event reasons read while ``what`` ran: each GPU's were read (else the check
    could not fail), and none shows a thermal or power-brake slowdown."""
    unread = gpu_health.unread_clock_events(results, ids)
    assert not unread, ("cannot read the clock event reasons under load from NVML:\n  "
                        + "\n  ".join(unread))
    slow = gpu_health.slowdowns_under_load(results, ids, what)
    assert not slow, "a GPU slowed down under load:\n  " + "\n  ".join(slow)


SUSTAIN_S = 30.0  # long enough for a GPU with poor cooling to heat up and throttle


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.benchmark
@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=requires(min_gpus=1, bf16=True)),
                                   pytest.param("fp16", marks=requires(min_gpus=1, fp16=True))])
def test_matmul_sustained(dtype: str, node, profile, metrics):
    """GPU-MATMUL-2: every GPU MUST hold its matmul speed under SUSTAIN_S of load: the last
    quarter's TFLOPS at least (100 - straggler_pct)% of the faster of the first two quarters',
    the windows' median at the floor, and no thermal or power-brake slowdown meanwhile."""
    n, results, ids, floor = _matmul_on_every_gpu(collective_ranks.matmul_sustained, dtype,
                                                  node, profile, SUSTAIN_S)
    record_sustained(metrics, dtype, results, ids, floor,
                     gpu_health.straggler_pct(profile.straggler_pct), sustain_s=SUSTAIN_S,
                     world_size=n)
    _no_slowdown(results, ids, f"{SUSTAIN_S:g} s of {dtype} matmul")


def record_sustained(metrics, dtype: str, results: list[dict[str, Any]],
                     ids: list[gpu_health.GpuIdentity], floor: float | None,
                     straggler_pct: float, **params: Any) -> None:
    """Each GPU's TFLOPS per window (median held to ``floor``) and its last quarter's speed as a
    percentage of its start's, the faster of its first two quarters (held to 100 -
    straggler_pct), by the recorder."""
    size = results[0]["size"]
    flops = gpu_health.matmul_flops(size, size, size)
    for res, ident in zip(results, ids):
        where = {"who": ident.label, **ident.params(), **params, "m": size,
                 "window_s": res["window_s"]}
        windows = res["windows"]
        metrics.record_rate(f"matmul.{dtype}.sustained", windows, amount=flops, unit="TFLOPS",
                            scale=TFLOPS, floor=floor, **where)
        quarter = max(1, len(windows) // 4)
        # The start's speed: the faster of the first two quarters (clocks ramping up, or a
        # neighbour still starting, can slow the very first windows).
        start = min(statistics.median(windows[:quarter]),
                    statistics.median(windows[quarter:2 * quarter] or windows[:quarter]))
        last = statistics.median(windows[-quarter:])
        metrics.record(f"matmul.{dtype}.sustained_pct_of_start", 100.0 * start / last,
                       unit="%", better="higher", limit=100.0 - straggler_pct, **where)


# ------------------------------------------------------------------ cross-check

@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.benchmark
@requires(min_gpus=2)
def test_nccl_tests_cross_check(node, profile, run, metrics):
    """COLL-XCHECK-1: all_reduce busbw MUST be >= 90% of nccl-tests' at each floor size."""
    exe = nccl_tests.find()
    if exe is None:
        pytest.skip(f"Requires: [nccl-tests {nccl_tests.EXECUTABLE} on PATH (found none)]")
    if run.multinode or rendezvous_info() is not None:
        pytest.skip("nccl-tests cross-check runs on one node outside torchrun/Slurm "
                    "(all_reduce_perf -g drives every GPU from one process)")
    gpus = worker_gpus()
    n = len(gpus)
    floors = sorted({f.bytes for f in profile.nccl_floors
                     if f.collective == "all_reduce" and (f.world_size or n) == n})
    sizes = floors or [collectives.GIB, 4 * collectives.GIB]
    theirs, commands = nccl_tests.run(exe, sizes, gpus, iters=NCCL_TESTS_ITERS,
                                      timeout_s=TIMEOUT_S)
    factor = collectives.bus_factor("all_reduce", n)
    wrong = []
    for nbytes in sizes:
        iters = collectives.iterations(nbytes, "cuda")
        ours = run_ranks(collective_calls.measure, n, timeout_s=TIMEOUT_S,
                         args=("all_reduce", [(nbytes, iters)]), accelerator="cuda")[0]
        rows = theirs[nbytes]
        params = {"bytes": nbytes, "world_size": n}
        metrics.record_rate("nccl_tests.all_reduce.busbw", [r.seconds for r in rows],
                            amount=nbytes * factor, unit="GB/s", scale=GB,
                            iters=NCCL_TESTS_ITERS, **params)
        mine = statistics.median(nbytes * factor / GB / s for s in ours["points"][0]["seconds"])
        # One number per size (the medians' ratio); both sides' rounds are recorded apart
        # (ours by COLL-BW-2 and the sweep).
        metrics.record("all_reduce.busbw_ratio_to_nccl_tests",
                       mine / statistics.median(r.busbw_gbps for r in rows), unit="ratio",
                       better="higher", limit=MIN_RATIO_TO_NCCL_TESTS, iters=iters, **params)
        wrong += [f"{nbytes} bytes: {r.wrong} wrong elements" for r in rows if r.wrong]
        ours_wrong = collectives.wrong_output_message(
            "all_reduce", nbytes, ours["points"][0]["wrong"], [f"ours, rank {r}" for r in range(n)])
        if ours_wrong:
            wrong.append(ours_wrong)
    assert not wrong, (f"nccl-tests found wrong all_reduce results ({'; '.join(commands)}): "
                       + "; ".join(wrong))
