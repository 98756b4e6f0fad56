"""Code run inside ranks by suites/test_collectives.py (module-level: picklable by reference)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dsconform.suite import device, rank, world


# Bus bandwidth factors, as nccl-tests defines them (doc/PERFORMANCE.md): busbw = algbw * factor.
def bus_factor(collective: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0}[collective]


def _op(collective: str, nbytes: int, dev: torch.device):
    """Buffers and a callable for one collective moving `nbytes` (nccl-tests' "size": the
    total buffer, i.e. the output of all_gather and the input of reduce_scatter), fp32."""
    n = world()
    count = nbytes // 4
    per_rank = count // n
    if collective == "all_reduce":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, lambda: dist.all_reduce(buf)
    if collective == "all_gather":
        inp = torch.empty(per_rank, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        return inp, lambda: dist.all_gather_into_tensor(out, inp)
    if collective == "reduce_scatter":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank, dtype=torch.float32, device=dev)
        return inp, lambda: dist.reduce_scatter_tensor(out, inp)
    if collective == "all_to_all":
        inp = torch.empty(per_rank * n, dtype=torch.float32, device=dev)
        out = torch.empty_like(inp)
        return inp, lambda: dist.all_to_all_single(out, inp)
    if collective == "broadcast":
        buf = torch.empty(count, dtype=torch.float32, device=dev)
        return buf, lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {collective!r}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def all_reduce_is_exact(numel: int) -> float:
    """Sum of rank+1 over ranks, in fp32: small integers, so every backend must be exact.
    Returns the largest deviation seen on this rank (0.0 when correct)."""
    dev = device()
    t = torch.full((numel,), float(rank() + 1), dtype=torch.float32, device=dev)
    dist.all_reduce(t)
    n = world()
    return float((t - n * (n + 1) / 2).abs().max())


def measure_busbw(collective: str, nbytes: int, iters: int, rounds: int = 3,
                  warmup: int = 5) -> dict:
    """Time ``rounds`` rounds of ``iters`` back-to-back collectives. Each round's time per call
    is the slowest rank's (as in nccl-tests, the job is as fast as its slowest rank), so every
    rank returns the same list."""
    dev = device()
    buf, op = _op(collective, nbytes, dev)
    buf.fill_(1.0)
    for _ in range(warmup):
        op()
    _sync(dev)
    per_call = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        _sync(dev)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                               device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        per_call.append(float(elapsed.item()))
    return {"seconds": per_call, "iters": iters, "bus_factor": bus_factor(collective, world())}
