"""Code run inside ranks by suites/test_collectives.py (module-level: picklable by reference),
beside the exactness and bandwidth calls it shares with the multi-node suite
(``collective_calls.check_exact`` and ``collective_calls.measure``,
dsconform/checks/collective_calls.py).

Every function here runs on real collectives (gloo on the CPU accelerator, NCCL on GPUs) and
returns plain data for the parent to check and record. Fault injection for the project's own red
tests (tests/test_collectives_*.py), off by default:
- ``delay_rank=r, delay_s=d``: rank r sleeps d seconds before every transfer it starts (it
  arrives late), or once per round inside its timed matmuls (its GPU is slow).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from dsconform.suite import (
    collective_calls,
    device,
    gather,
    gpu_health,
    rank,
    world,
)

# ------------------------------------------------------------------ exactness

def all_reduce_is_exact(numel: int) -> dict[str, float]:
    """Sum of rank+1 over ranks, in fp32: small integers, so every backend must be exact.
    Through deepspeed.comm (the API training uses) and torch.distributed beside it: the largest
    deviation each showed on this rank (0.0 when correct), by API."""
    import deepspeed.comm as dc

    dev, n = device(), world()
    worst = {}
    for api, call in (("deepspeed.comm", dc.all_reduce), ("torch.distributed", dist.all_reduce)):
        t = torch.full((numel,), float(rank() + 1), dtype=torch.float32, device=dev)
        call(t)
        worst[api] = float((t - n * (n + 1) / 2).abs().max())
    return worst


# ------------------------------------------------------------------ bandwidth

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
            collective_calls.synchronize(dev)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(iters):
                    if late:
                        time.sleep(late)
                    transfer()
                collective_calls.synchronize(dev)
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
    return {"identities": gather(collective_calls.identity()), "links": links,
            "bytes": buf.numel() * 4, "iters": iters}


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
        nvml, handle, self.why = gpu_health.nvml_handle(self._nvml, self.bus_id)
        if handle is None:
            return self
        read = gpu_health.clock_event_reader(nvml)
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
    dt = collective_calls.DTYPES[dtype]
    gen = torch.Generator(device=dev).manual_seed(seed + rank())
    a = torch.randn(size, size, generator=gen, device=dev).to(dt)
    b = torch.randn(size, size, generator=gen, device=dev).to(dt)
    c = torch.empty(size, size, dtype=dt, device=dev)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    collective_calls.synchronize(dev)
    return a, b, c


def matmul_seconds(dtype: str, size: int, iters: int, rounds: int = 3, warmup: int = 10,
                   delay_rank: int | None = None, delay_s: float = 0.0) -> dict[str, Any]:
    """Dense (size x size) @ (size x size) products in ``dtype`` on this rank's device, all
    ranks at once (as in training, every GPU busy): seconds per product, per round."""
    dev = device()
    a, b, c = _matmul_operands(dtype, size, 1234, warmup)
    late = delay_s if rank() == delay_rank else 0.0
    seconds = []
    me = collective_calls.identity()
    with ClockEvents(me["bus_id"]) as events:
        for _ in range(rounds):
            dist.barrier()
            collective_calls.synchronize(dev)
            start = time.perf_counter()
            if late:
                time.sleep(late)
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            collective_calls.synchronize(dev)
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
    me = collective_calls.identity()
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
                collective_calls.synchronize(dev)
                if t0 >= hot:  # the fault: 50 ms a product, far slower than any real one
                    time.sleep(0.4)
            windows.append((time.perf_counter() - start) / n)
    del a, b, c
    return {"identity": me, "windows": windows, "size": size, "window_s": window_s,
            **events.result()}
