"""The rank harness's contract: run_ranks runs fn on N ranks with torch.distributed initialised
by DeepSpeed, on spawned ranks kept alive between calls (dsconform.harness.groups; each xdist
worker has its own, dsconform.harness.xdist) or, under torchrun/Slurm, in this process as one
rank of the job (dsconform.harness.launcher); and the helpers fn uses inside a rank.
shutdown_pools() stops every group at session end (atexit too)."""

from __future__ import annotations

import atexit
from collections.abc import Callable

from dsconform.harness.errors import (
    RankError,
    RankTimeout,
    WorldSizeMismatch,
    check_accelerator,
    check_timeout,
    check_world_size,
    resolve,
)
from dsconform.harness.groups import GROUPS, spares_enabled
from dsconform.harness.launcher import external_rendezvous, run_external
from dsconform.harness.pool import gpus_for, pg_timeout_for, pickle_call, replies_healthy
from dsconform.harness.rank import all_agree, device, gather, rank, seed_everything, world
from dsconform.harness.xdist import (
    InsufficientGPUs,
    free_port,
    gpu_slice,
    gpus_per_worker,
    port_range,
    visible_gpus,
    worker_gpus,
    xdist_worker,
)

__all__ = [
    "InsufficientGPUs", "RankError", "RankTimeout", "WorldSizeMismatch", "all_agree", "device",
    "external_rendezvous", "free_port", "gather", "gpu_slice", "gpus_per_worker", "hold_spares",
    "port_range", "rank", "run_ranks", "seed_everything", "settle_spares", "shutdown_pools",
    "spares_enabled", "start_spares", "startup_phases", "startup_stats", "visible_gpus",
    "worker_gpus", "world", "xdist_worker",
]

#: The owner's operations under the names the plugin and fixtures use.
shutdown_pools = GROUPS.shutdown  # every rank group, at session end (and at exit)
hold_spares = GROUPS.quiet  # `with hold_spares():` nothing starts beside a measurement
settle_spares = GROUPS.settle  # wait for the groups still starting
startup_phases = GROUPS.startup_phases
atexit.register(shutdown_pools)


def startup_stats() -> dict[str, float]:
    """Groups started for run_ranks calls (pools; from_standby of them), the seconds calls
    waited for start-up (waited_s); lane groups started (lanes), calls run on lanes
    (lane_calls) and the seconds lanes waited for their ranks (lane_waited_s)."""
    with GROUPS.lock:
        return dict(GROUPS.stats)


def start_spares(world_sizes: list[int], accelerator: str = "cuda", *,
                 fresh: bool = False) -> list[tuple]:
    """Start standby ranks for these world sizes now (fresh: the never-warmed ones that
    fresh-process calls take); returns the keys kept, leaving out world sizes this xdist
    worker has too few GPUs for."""
    kept = []
    for ws in world_sizes:
        try:
            base = (ws, accelerator, gpus_for(ws, accelerator))
        except InsufficientGPUs:
            continue
        if _keep_standby(base, "fresh" if fresh else "standby"):
            kept.append(base)
    return kept


def _keep_standby(base: tuple, kind: str) -> bool:
    if spares_enabled(base[1]):
        GROUPS.keep((*base, kind), 1)
        return bool(GROUPS.idle((*base, kind)))
    return False


def run_ranks(fn: Callable, world_size: int | None, *, timeout_s: float, args: tuple = (),
              kwargs: dict | None = None, accelerator: str | None = None,
              reuse: bool = True) -> list:
    """Run fn(*args, **kwargs) on world_size ranks; return the per-rank results (index = rank).

    accelerator: "cuda" (nccl, rank i on the i-th GPU of this xdist worker), "cpu" (gloo,
    DeepSpeed's CPU accelerator even on a GPU node), or None (cuda if the parent sees a GPU).
    reuse: keep the rank processes for the next call of the same world size and accelerator.
    timeout_s: how long fn may run; startup has its own STARTUP_TIMEOUT_S.
    Raises RankError (a rank raised or died, or ranks disagreed on a skip), RankTimeout,
    pytest's Skipped when every rank skipped for the same reason, InsufficientGPUs.
    Under torchrun/Slurm (external_rendezvous()), runs fn in this process as one rank; there
    world_size must equal the job's size or be None/-1 ("whatever the job has")."""
    check_timeout(timeout_s)
    args, kwargs = tuple(args), dict(kwargs or {})
    if external_rendezvous():
        return run_external(fn, world_size, timeout_s, args, kwargs, accelerator)
    check_world_size(world_size)
    accelerator, timeout_s = check_accelerator(accelerator), float(timeout_s)
    call = pickle_call(fn, args, kwargs)
    base = (world_size, accelerator, gpus_for(world_size, accelerator))
    token = object()
    if reuse:
        pool = GROUPS.lease(base, ("pooled", "standby"), "plain", pg_timeout_for(timeout_s),
                            token)
    else:
        pool = GROUPS.lease(base, ("fresh",), "plain", timeout_s + 60, token)
        # A fresh-process call is often followed by another (save, then load in new
        # processes): its replacement starts now.
        _keep_standby(base, "fresh")
    healthy = False
    try:
        replies = pool.call(fn, call, timeout_s)
        healthy = replies_healthy(replies)
        return resolve(replies)
    finally:
        # Anything else (an exception, a timeout, Ctrl-C) leaves ranks mid-call: never reuse.
        GROUPS.release(pool, healthy, "pooled" if reuse else None)
        if reuse:
            # After the call, not during it: the replacement must not share the node with
            # what the call measured.
            _keep_standby(base, "standby")
