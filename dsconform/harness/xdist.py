"""How pytest-xdist workers share one node: disjoint rendezvous ports and disjoint GPUs, from
the arguments or the environment only, so tests are gated and checked without GPUs."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dsconform import settings

#: Ports each xdist worker may use for rendezvous; 100 leaves room for a respawn per failing
#: test in a long session without wrapping onto a port whose TCPStore may still be closing.
PORT_STRIDE = 100
DEFAULT_PORT_BASE = 29500


class InsufficientGPUs(RuntimeError):
    """This xdist worker (or this node) has fewer GPUs than the request needs."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


def xdist_worker() -> tuple[int, int]:
    """(worker index, worker count) from pytest-xdist's environment; (0, 1) without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count_text = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not name:
        return 0, 1
    if not name.startswith("gw") or not name[2:].isdigit():
        raise ValueError(f"PYTEST_XDIST_WORKER={name!r} is not of the form gwN")
    index = int(name[2:])
    try:
        count = int(count_text) if count_text else index + 1
    except ValueError:
        raise ValueError(f"PYTEST_XDIST_WORKER_COUNT={count_text!r} is not an integer") from None
    if not 0 <= index < count:
        raise ValueError(f"PYTEST_XDIST_WORKER={name} is outside PYTEST_XDIST_WORKER_COUNT={count}")
    return index, count


def port_range(worker_index: int) -> range:
    """The rendezvous ports reserved for one xdist worker: disjoint from every other worker's."""
    base = settings.get("DSCONFORM_PORT_BASE")
    base = DEFAULT_PORT_BASE if base is None else base
    start = base + worker_index * PORT_STRIDE
    stop = start + PORT_STRIDE
    if start < 1024 or stop > 65536:
        raise ValueError(
            f"ports {start}-{stop - 1} for xdist worker {worker_index} fall outside 1024-65535; "
            f"lower DSCONFORM_PORT_BASE (now {base}) or run fewer workers")
    return range(start, stop)


_next_port_offset: dict[int, int] = {}


def free_port(worker_index: int | None = None) -> int:
    """A port inside this worker's range that nothing listens on now; successive calls walk
    the range, so a new pool does not reuse the port of the pool just killed (its DeepSpeed shm
    segments are named after the port)."""
    if worker_index is None:
        worker_index = xdist_worker()[0]
    ports = port_range(worker_index)
    # Start at a pid-dependent offset so two pytest sessions on one node rarely probe in step.
    offset = _next_port_offset.get(worker_index, os.getpid() % len(ports))
    for step in range(len(ports)):
        index = (offset + step) % len(ports)
        # No SO_REUSEADDR: a port still in TIME_WAIT from a killed TCPStore counts as busy, so
        # the next pool does not race a half-closed store.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", ports[index]))
            except OSError:
                continue
        _next_port_offset[worker_index] = index + 1
        return ports[index]
    raise RuntimeError(
        f"no free port in {ports.start}-{ports.stop - 1} (xdist worker {worker_index}); "
        "another job uses them: set DSCONFORM_PORT_BASE to a free range")


#: How many ports a rank group tries before it gives up: another process (a second suite run,
#: a user's torchrun) can take a port between the probe and the bind.
BIND_ATTEMPTS = 10

#: The rank environment that makes every rank a client of the store the parent holds
#: (torch.distributed.rendezvous: the store of a torchelastic agent), so no rank binds a port.
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def bind_rendezvous_store(timeout_s: float,
                          log: Callable[[str], None] | None = None) -> tuple[Any, int]:
    """A TCPStore server for one rank group, bound here, not in rank 0: (store, port). A port
    taken between probe and bind is skipped (told to ``log``), BIND_ATTEMPTS times in all; the
    ranks connect as clients (AGENT_STORE_ENV) while the returned store lives."""
    from torch.distributed import TCPStore

    taken = []
    for _ in range(BIND_ATTEMPTS):
        port = free_port()
        try:
            store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s),
                             wait_for_workers=False)
            return store, port
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            if not any(s in str(exc).lower() for s in ("eaddrinuse", "address already in use")):
                raise
            taken.append(port)
            if log is not None:
                log(f"rendezvous port {port} was taken by another process after it was found "
                    f"free; trying another ({len(taken)} of {BIND_ATTEMPTS} tries)")
    raise RuntimeError(
        f"no rendezvous port could be bound in {BIND_ATTEMPTS} tries (taken: "
        f"{', '.join(map(str, taken))}); another job uses ports "
        f"{port_range(xdist_worker()[0]).start}-{port_range(xdist_worker()[0]).stop - 1}: "
        "set DSCONFORM_PORT_BASE to a free range")


def visible_gpus() -> list[str]:
    """GPU ids this process may hand out: CUDA_VISIBLE_DEVICES if set, else 0..count-1."""
    if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [item.strip() for item in listed.split(",") if item.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpus_per_worker(total_gpus: int, worker_count: int) -> int:
    """GPUs each xdist worker gets: DSCONFORM_GPUS_PER_WORKER, else an even share."""
    value = settings.get("DSCONFORM_GPUS_PER_WORKER")
    if value is not None:
        if value < 0:
            raise ValueError(f"DSCONFORM_GPUS_PER_WORKER={value} must be >= 0")
        return value
    return total_gpus // max(worker_count, 1)


def gpu_slice(worker_index: int, gpus_per_worker: int, visible: list[str]) -> list[str]:
    """GPUs [K*g, (K+1)*g) of `visible` for worker K; InsufficientGPUs if they do not all exist."""
    start = worker_index * gpus_per_worker
    chosen = list(visible[start:start + gpus_per_worker])
    if len(chosen) < gpus_per_worker:
        raise InsufficientGPUs(
            f"xdist worker gw{worker_index} needs GPUs {start}..{start + gpus_per_worker - 1} "
            f"({gpus_per_worker} per worker) but only {len(visible)} are visible "
            f"({','.join(visible) or 'none'}); run fewer workers (-n) or lower "
            "DSCONFORM_GPUS_PER_WORKER", needed=gpus_per_worker, available=len(chosen))
    return chosen


def worker_gpus() -> list[str]:
    """The GPUs this xdist worker owns (all visible GPUs without xdist)."""
    index, count = xdist_worker()
    visible = visible_gpus()
    return gpu_slice(index, gpus_per_worker(len(visible), count), visible)
