"""Code run inside ranks by suites/test_collectives.py (module-level: picklable by reference).

Every function here runs on real collectives (gloo on the CPU accelerator, NCCL on GPUs) and
returns plain data for the parent to check and record. Fault injection for the project's own red
tests (tests/test_collectives_*.py), off by default:
- ``perturb={"rank": r, "numel": m, "index": i}``: on rank r, the deepspeed.comm call for size m
  returns its output with element i off by one (a wrapper around the real call).
- ``delay_rank=r, delay_s=d``: rank r sleeps d seconds before every collective call or transfer
  it starts (it arrives late), or once per round inside its timed matmuls (its GPU is slow).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsconform.suite import collectives, device, gather, rank, world

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def identity() -> dict[str, Any]:
    """What this rank computes on. On GPUs the PCI address comes from the device itself, so it
    is right whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER did to torch's numbering; the
    parent maps it to nvidia-smi's index (dsconform/node/gpu_health.py)."""
    dev = device()
    info: dict[str, Any] = {"rank": rank(), "device": "cpu", "bus_id": None, "visible": None}
    if dev.type != "cuda":
        return info
    props = torch.cuda.get_device_properties(dev)
    bus = getattr(props, "pci_bus_id", None)  # torch >= 2.2
    if bus is not None:
        info["bus_id"] = (f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:"
                          f"{getattr(props, 'pci_device_id', 0) or 0:02x}.0")
    listed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    index = dev.index or 0
    info["device"] = f"cuda:{index}"
    info["visible"] = listed[index] if index < len(listed) and listed[index] else str(index)
    return info


# ------------------------------------------------------------------ exactness

def all_reduce_is_exact(numel: int) -> float:
    """Sum of rank+1 over ranks, in fp32: small integers, so every backend must be exact.
    Returns the largest deviation seen on this rank (0.0 when correct)."""
    dev = device()
    t = torch.full((numel,), float(rank() + 1), dtype=torch.float32, device=dev)
    dist.all_reduce(t)
    n = world()
    return float((t - n * (n + 1) / 2).abs().max())


def _with_fault(call: Callable, index: int) -> Callable:
    """The real deepspeed.comm call, then element ``index`` of its output (the first argument,
    as in every call used here) off by one: a rank whose collective returns one wrong value."""
    def faulty(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = call(out, *args, **kwargs)
        out.view(-1)[index] += 1
        return result
    return faulty


def _narrowed(call: Callable, narrow: torch.dtype) -> Callable:
    """The real deepspeed.comm call, then its output rounded through ``narrow`` (bf16, fp16):
    a rank whose collective carries the data in a narrower type (a compression hook)."""
    def faulty(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = call(out, *args, **kwargs)
        out.copy_(out.to(narrow).to(out.dtype))
        return result
    return faulty


def _ds_calls() -> dict[str, Callable]:
    """The deepspeed.comm entry points ZeRO uses for each collective."""
    import deepspeed.comm as dc

    return {"all_reduce": dc.all_reduce, "all_gather": dc.allgather_fn,
            "reduce_scatter": dc.reduce_scatter_fn, "broadcast": dc.broadcast,
            "all_to_all": dc.all_to_all_single}


def _run_exact(collective: str, case: Any, dtype: torch.dtype, call: Callable,
               dev: torch.device) -> torch.Tensor:
    inp = case.as_float(case.input, dtype)
    if collective == "all_reduce":
        out = inp.clone()
        call(out)
    elif collective == "broadcast":
        out = inp.clone()
        call(out, src=case.src)
    elif collective == "all_to_all":
        out = torch.empty(sum(case.output_splits), dtype=dtype, device=dev)
        call(out, inp, output_split_sizes=case.output_splits,
             input_split_sizes=case.input_splits)
    else:  # all_gather, reduce_scatter: (output, input)
        out = torch.empty(case.expected.numel(), dtype=dtype, device=dev)
        call(out, inp)
    return out


def check_exact(collective: str, dtype: str, sizes: Sequence[int],
                perturb: dict[str, int] | None = None) -> dict[str, Any]:
    """Run ``collective`` through deepspeed.comm on known data at every size; this rank's
    identity and the mismatches it saw (every size runs on every rank, so no rank is left
    waiting in a collective when another one found a wrong value)."""
    dev, n, me = device(), world(), rank()
    mismatches = []
    for numel in sizes:
        call = _ds_calls()[collective]
        if perturb and perturb["rank"] == me and perturb["numel"] == numel:
            call = (_narrowed(call, DTYPES[perturb["narrow"]]) if "narrow" in perturb
                    else _with_fault(call, perturb["index"]))
        case = collectives.exact_case(collective, me, n, numel, dev, dtype)
        out = _run_exact(collective, case, DTYPES[dtype], call, dev)
        found = collectives.find_mismatch(out, case.as_float(case.expected, DTYPES[dtype]))
        if found is not None:
            index, expected, value, wrong = found
            mismatches.append(dict(collective=collective, dtype=dtype, numel=numel, rank=me,
                                   index=index, expected=expected, found=value, wrong=wrong,
                                   total=out.numel(), layout=case.layout))
        del out, case
    return {"identity": identity(), "mismatches": mismatches}


# ------------------------------------------------------------------ bandwidth

def _op(collective: str, nbytes: int,
        dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Input, output (the same tensor where the call works in place) and a callable for one
    collective moving ``nbytes`` (nccl-tests' "size": the total buffer, i.e. the output of
    all_gather and the input of reduce_scatter), fp32, through torch.distributed (the way the
    profile's floors were measured)."""
    n = world()
    count = nbytes // 4
    per_rank = count // n
    if collective == "all_reduce":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, buf, lambda: dist.all_reduce(buf)
    if collective == "all_gather":
        inp = torch.empty(per_rank, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        return inp, out, lambda: dist.all_gather_into_tensor(out, inp)
    if collective == "reduce_scatter":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank, dtype=torch.float32, device=dev)
        return inp, out, lambda: dist.reduce_scatter_tensor(out, inp)
    if collective == "all_to_all":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty_like(inp)
        return inp, out, lambda: dist.all_to_all_single(out, inp)
    if collective == "broadcast":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, buf, lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {collective!r}")


def _wrong_after_one_call(collective: str, inp: torch.Tensor, out: torch.Tensor,
                          op: Callable, partial: bool = False) -> int:
    """Elements of one call's output that are not what the timed collective, at the timed size,
    must return when every rank's input is rank + 1: a collective that does only part of the
    work at large sizes is fast, and would pass a floor, but is wrong."""
    n, me = world(), rank()
    inp.fill_(float(me + 1))
    op()
    if partial:  # fault injection (the project's red test): the last quarter left as it was
        out.view(-1)[out.numel() * 3 // 4:] = 0.0
    if collective in ("all_reduce", "reduce_scatter"):
        return int(out.ne(n * (n + 1) / 2).sum())
    if collective == "broadcast":
        return int(out.ne(1.0).sum())  # from rank 0
    # all_gather, all_to_all: the part from rank s holds s + 1
    want = torch.arange(1, n + 1, dtype=out.dtype, device=out.device).unsqueeze(1)
    return int(out.view(n, -1).ne(want).sum())


class _CallTimer:
    """Time this rank spends inside each call: CUDA events around the call on the GPU (no host
    synchronisation per call, so back-to-back timing is unchanged), the host clock on the CPU.
    A rank its peers wait for spends the least time inside (dsconform/node/gpu_health.py)."""

    def __init__(self, dev: torch.device, iters: int) -> None:
        self.cuda = dev.type == "cuda"
        self.events = ([(torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
                       if self.cuda else [])
        self.spent = 0.0
        self._t = 0.0

    def reset(self) -> None:
        self.spent = 0.0

    def begin(self, i: int) -> None:
        if self.cuda:
            self.events[i][0].record()
        else:
            self._t = time.perf_counter()

    def end(self, i: int) -> None:
        if self.cuda:
            self.events[i][1].record()
        else:
            self.spent += time.perf_counter() - self._t

    def total(self) -> float:
        """Seconds inside the calls of this round (after the device was synchronised)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return self.spent


def measure(collective: str, points: Sequence[tuple[int, int]], rounds: int = 3,
            warmup: int = 5, delay_rank: int | None = None,
            delay_s: float = 0.0, partial_rank: int | None = None) -> dict[str, Any]:
    """For each (bytes, iters) point: ``rounds`` rounds of ``iters`` back-to-back calls, then
    one call on known data whose output is checked (``wrong[r]``: rank r's wrong elements).

    ``seconds[k]``: round k's time per call, the slowest rank's (as in nccl-tests, the job is
    as fast as its slowest rank), the same on every rank. ``inside[r][k]``: the time per call
    rank r spent inside the calls in round k. Every rank returns the same dict."""
    dev = device()
    late = delay_s if rank() == delay_rank else 0.0
    out = []
    for nbytes, iters in points:
        buf, result, op = _op(collective, nbytes, dev)
        buf.fill_(1.0)
        for _ in range(warmup):
            op()
        _sync(dev)
        timer = _CallTimer(dev, iters)
        seconds, inside = [], []
        for _ in range(rounds):
            timer.reset()
            dist.barrier()
            start = time.perf_counter()
            for i in range(iters):
                if late:
                    time.sleep(late)
                timer.begin(i)
                op()
                timer.end(i)
            _sync(dev)
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                                   device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds.append(float(elapsed.item()))
            inside.append(timer.total() / iters)
        wrong = _wrong_after_one_call(collective, buf, result, op, rank() == partial_rank)
        del buf, result, op, timer
        out.append({"bytes": nbytes, "iters": iters, "seconds": seconds,
                    "inside": gather(inside), "wrong": gather(wrong)})
    return {"identities": gather(identity()), "points": out, "world_size": world()}


def measure_pairs(nbytes: int, iters: int, rounds: int = 3, warmup: int = 3,
                  delay_rank: int | None = None, delay_s: float = 0.0) -> dict[str, Any]:
    """Point-to-point bandwidth of every ordered pair (src -> dst) of ranks, one pair at a time
    while the others wait: ``rounds`` rounds of ``iters`` sends of ``nbytes``. A link's time per
    round is the slower of its two ends. Every rank returns the same dict."""
    dev, n, me = device(), world(), rank()
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    mine: dict[str, list[float]] = {}
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            dist.barrier()
            if me not in (src, dst):
                continue
            late = delay_s if me == src == delay_rank else 0.0

            def transfer(src: int = src, dst: int = dst) -> None:
                if me == src:
                    dist.send(buf, dst)
                else:
                    dist.recv(buf, src)

            for _ in range(warmup):
                transfer()
            _sync(dev)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(iters):
                    if late:
                        time.sleep(late)
                    transfer()
                _sync(dev)
                times.append((time.perf_counter() - start) / iters)
            mine[f"{src}->{dst}"] = times
    dist.barrier()
    per_rank = gather(mine)
    links = []
    for src in range(n):
        for dst in range(n):
            if src != dst:
                key = f"{src}->{dst}"
                links.append({"src": src, "dst": dst,
                              "seconds": [max(a, b) for a, b in zip(per_rank[src][key],
                                                                    per_rank[dst][key])]})
    return {"identities": gather(identity()), "links": links, "bytes": buf.numel() * 4,
            "iters": iters}


# ------------------------------------------------------------------ compute

class ClockEvents:
    """While the ``with`` block runs, a thread reads this rank's GPU's NVML clock event reasons
    every ``every_s`` and ORs them (dsconform/node/gpu_health.py SLOWDOWN_REASONS names the faults):
    a thermal or power-brake slowdown that sets in under load, which an idle reading at profile
    time (PROF-GPU-6) cannot see. ``mask`` stays None where NVML or the GPU's bus id is
    missing (``why`` says which)."""

    def __init__(self, bus_id: str | None, every_s: float = 0.02) -> None:
        self.bus_id, self.every_s = bus_id, every_s
        self.mask: int | None = None
        self.samples = 0
        self.why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = contextlib.ExitStack()

    def __enter__(self) -> ClockEvents:
        from dsconform.node.detect import nvml_devices
        from dsconform.node.gpu_health import canonical_bus_id, clock_event_reader, nvml_bus_id

        if self.bus_id is None:
            self.why = "no PCI bus id for this rank's device"
            return self
        try:
            nvml, handles = self._nvml.enter_context(nvml_devices())
        except Exception as e:  # noqa: BLE001 - NVML missing: say so, do not fail the rank
            self.why = f"NVML unavailable: {e}"
            return self
        mine = canonical_bus_id(self.bus_id)
        handle = next((h for h in handles if nvml_bus_id(nvml, h) == mine), None)
        if handle is None:
            self.why = f"NVML lists no GPU at {self.bus_id}"
            return self
        read = clock_event_reader(nvml)
        self.mask = 0

        def poll() -> None:
            while True:
                self.mask |= int(read(handle))
                self.samples += 1
                if self._stop.wait(self.every_s):
                    return

        self._thread = threading.Thread(target=poll, name="clock-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._nvml.close()  # NVML shut down, if it was started

    def result(self) -> dict[str, Any]:
        return {"clock_events_mask": self.mask, "clock_event_samples": self.samples,
                "clock_events_why": self.why}


def _matmul_operands(dtype: str, size: int, seed: int, warmup: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two random (size x size) operands and an output in ``dtype`` on this rank's device,
    after ``warmup`` products (which also let the clocks ramp up)."""
    dev = device()
    dt = DTYPES[dtype]
    gen = torch.Generator(device=dev).manual_seed(seed + rank())
    a = torch.randn(size, size, generator=gen, device=dev).to(dt)
    b = torch.randn(size, size, generator=gen, device=dev).to(dt)
    c = torch.empty(size, size, dtype=dt, device=dev)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    _sync(dev)
    return a, b, c


def matmul_seconds(dtype: str, size: int, iters: int, rounds: int = 3, warmup: int = 10,
                   delay_rank: int | None = None, delay_s: float = 0.0) -> dict[str, Any]:
    """Dense (size x size) @ (size x size) products in ``dtype`` on this rank's device, all
    ranks at once (as in training, every GPU busy): seconds per product, per round."""
    dev = device()
    a, b, c = _matmul_operands(dtype, size, 1234, warmup)
    late = delay_s if rank() == delay_rank else 0.0
    seconds = []
    me = identity()
    with ClockEvents(me["bus_id"]) as events:
        for _ in range(rounds):
            dist.barrier()
            _sync(dev)
            start = time.perf_counter()
            if late:
                time.sleep(late)
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            _sync(dev)
            seconds.append((time.perf_counter() - start) / iters)
    del a, b, c
    return {"identity": me, "seconds": seconds, "size": size, "iters": iters,
            **events.result()}


def matmul_sustained(dtype: str, size: int, seconds: float, window_s: float = 1.0,
                     throttle_rank: int | None = None, throttle_after: float = 0.5
                     ) -> dict[str, Any]:
    """Dense products back to back for ``seconds`` on every rank at once (a training step's
    load, long enough for the GPU to heat up): seconds per product in each ``window_s``
    window, and the clock event reasons seen meanwhile. ``throttle_rank`` (the project's red
    test) makes that rank take 50 ms a product once ``throttle_after`` of the time has passed
    (a fixed delay: on a shared CPU the products' own time varies 40-fold)."""
    dev = device()
    a, b, c = _matmul_operands(dtype, size, 4321, 10)
    me = identity()
    windows: list[float] = []
    dist.barrier()
    with ClockEvents(me["bus_id"]) as events:
        begin = time.perf_counter()
        end = begin + seconds
        hot = begin + throttle_after * seconds if rank() == throttle_rank else math.inf
        while time.perf_counter() < end:
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < window_s:
                t0 = time.perf_counter()
                for _ in range(8):
                    torch.matmul(a, b, out=c)
                n += 8
                _sync(dev)
                if t0 >= hot:  # the fault: 50 ms a product, far slower than any real one
                    time.sleep(0.4)
            windows.append((time.perf_counter() - start) / n)
    del a, b, c
    return {"identity": me, "windows": windows, "size": size, "window_s": window_s,
            **events.result()}
