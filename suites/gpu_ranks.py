"""Code run inside the ranks of suites/test_gpu.py: each GPU's memory bandwidth, its pinned
host transfers each way, and its PCIe link as NVML reports it while those transfers run."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from dsconform.suite import (
    collective_calls,
    device,
    gpu_health,
    rank,
    world,
)


class PcieLink:
    """While the ``with`` block runs, a thread reads this rank's GPU's current PCIe link
    generation and width every ``every_s`` and keeps the highest of each; ``max_gen`` /
    ``max_width`` are what the GPU and the system it sits in allow (NVML). An idle link may
    train down to save power, so only a link under load is judged. ``why`` says why nothing
    was read."""

    def __init__(self, bus_id: str | None, every_s: float = 0.02) -> None:
        self.bus_id, self.every_s = bus_id, every_s
        self.gen: int | None = None
        self.width: int | None = None
        self.max_gen: int | None = None
        self.max_width: int | None = None
        self.samples = 0
        self.why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = contextlib.ExitStack()

    def __enter__(self) -> PcieLink:
        nvml, handle, self.why = gpu_health.nvml_handle(self._nvml, self.bus_id)
        if handle is None:
            return self
        try:
            self.max_gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
            self.max_width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        except Exception as e:
            self.why = f"NVML cannot read the link's maximum: {e}"
            return self

        def sample() -> None:
            while True:
                try:
                    gen = int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
                    width = int(nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
                    self.gen = gen if self.gen is None else max(self.gen, gen)
                    self.width = width if self.width is None else max(self.width, width)
                    self.samples += 1
                except Exception as e:
                    self.why = f"NVML cannot read the current link: {e}"
                if self._stop.wait(self.every_s):
                    return

        self._thread = threading.Thread(target=sample, name="dsconform-pcie", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self._nvml.close()

    def result(self) -> dict[str, Any]:
        return {"pcie": {"gen": self.gen, "width": self.width, "max_gen": self.max_gen,
                         "max_width": self.max_width, "samples": self.samples,
                         "why": self.why}}


def _timed(fn: Any, dev: torch.device, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        collective_calls.synchronize(dev)
        start = time.perf_counter()
        fn()
        collective_calls.synchronize(dev)
        out.append(time.perf_counter() - start)
    return out


def copy_seconds(hbm_bytes: int, host_bytes: int, rounds: int = 5) -> dict[str, Any]:
    """Seconds per round of: a device-to-device copy of ``hbm_bytes`` (every GPU at once, as
    in training), then, one GPU at a time (the host's links and memory are shared), a pinned
    host-to-device and a device-to-host copy of ``host_bytes``, with the PCIe link read
    meanwhile. A first copy of each kind warms up and is not timed."""
    dev = device()
    me = collective_calls.identity()
    src = torch.empty(hbm_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    dist.barrier()
    hbm = _timed(functools.partial(dst.copy_, src), dev, rounds)
    src = dst = None  # free the device memory before the host transfers
    host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    on_gpu = torch.empty(host_bytes, dtype=torch.uint8, device=dev)
    h2d: list[float] = []
    d2h: list[float] = []
    link = PcieLink(me["bus_id"])
    for turn in range(world()):
        dist.barrier()
        if turn != rank():
            continue
        on_gpu.copy_(host, non_blocking=True)
        host.copy_(on_gpu, non_blocking=True)
        with link:
            h2d = _timed(functools.partial(on_gpu.copy_, host, non_blocking=True), dev, rounds)
            d2h = _timed(functools.partial(host.copy_, on_gpu, non_blocking=True), dev, rounds)
    dist.barrier()
    return {"identity": me, "hbm_bytes": hbm_bytes, "hbm_seconds": hbm,
            "host_bytes": host_bytes, "h2d_seconds": h2d, "d2h_seconds": d2h,
            **link.result()}
