"""The rank harness's contract: run a function on N ranks with torch.distributed initialised
by DeepSpeed (``run_ranks``), and the helpers fn uses inside a rank.

Every distributed test in the suite goes through `run_ranks`. Two modes:

* Spawned (the default on one node): `world_size` rank processes started with the
  multiprocessing *spawn* context, kept alive between calls (a pool per world size,
  accelerator and GPU slice: dsconform.harness.pool) so only the first call pays for importing
  deepspeed and initialising the process group. A failing, dying or hanging rank fails that
  one call and tears its pool down; the next call starts fresh processes. Standby ranks
  (dsconform.harness.standby) are started in the background so a call that needs new
  processes does not wait for them; lanes (dsconform.harness.lanes) run independent calls at
  once.
* External (under torchrun, the DeepSpeed launcher or Slurm, see `external_rendezvous` and
  dsconform.harness.launcher): the current process is one rank of a job that already has a
  rendezvous; fn runs in-process and the ranks exchange outcomes so that every rank returns,
  skips or fails alike.

Inside fn, use the helpers re-exported here: rank(), world(), device(), seed_everything(),
gather(), all_agree().

Call `shutdown_pools()` at the end of a pytest session (an atexit hook also does it).
run_ranks calls are serialised (one lock per process); a pytest-xdist worker has its own pools,
ports and GPUs (see dsconform.harness.xdist).
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable

from dsconform.harness import standby
from dsconform.harness.errors import (
    RankError,
    RankTimeout,
    WorldSizeMismatch,
    check_accelerator,
    check_timeout,
    check_world_size,
    resolve,
)
from dsconform.harness.launcher import external_rendezvous, run_external
from dsconform.harness.pool import (
    CALLS_LOCK,
    LANE_POOLS,
    MAX_POOLS,
    POOLS,
    STATS,
    TABLES_LOCK,
    close_idle,
    gpus_for,
    pg_timeout_for,
    pickle_call,
    replies_healthy,
    send_and_collect,
    start_pool,
    startup_phases,
    startup_stats,
)
from dsconform.harness.rank import all_agree, device, gather, rank, seed_everything, world
from dsconform.harness.standby import hold_spares, settle_spares, spares_enabled, start_spares
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
    "InsufficientGPUs", "RankError", "RankTimeout", "WorldSizeMismatch",
    "all_agree", "device", "external_rendezvous", "free_port", "gather", "gpu_slice",
    "gpus_per_worker", "hold_spares", "port_range", "rank", "run_ranks", "seed_everything",
    "settle_spares", "shutdown_pools", "spares_enabled", "start_spares",
    "startup_phases", "startup_stats",
    "visible_gpus", "worker_gpus", "world", "xdist_worker",
]


def shutdown_pools() -> None:
    """Stop every pooled rank process, all at once (pooled, standby and lane pools). The pytest
    plugin calls this at session end."""
    with TABLES_LOCK:
        pools = list(POOLS.values()) + list(standby.SPARES.values()) \
            + [p for lane in LANE_POOLS.values() for p in lane]
        POOLS.clear()
        standby.SPARES.clear()
        LANE_POOLS.clear()
        close_idle(pools)


atexit.register(shutdown_pools)


def _run_spawned(fn: Callable, world_size: int, timeout_s: float, args: tuple, kwargs: dict,
                 accelerator: str, reuse: bool) -> list:
    call = pickle_call(fn, args, kwargs)
    gpus = gpus_for(world_size, accelerator)
    key = (world_size, accelerator, gpus)
    # CALLS_LOCK serialises run_ranks calls; TABLES_LOCK only guards the pool tables, so a
    # background cell batch (dsconform.plugin.batch) can take and start its lanes meanwhile.
    with CALLS_LOCK:
        with TABLES_LOCK:
            pool = POOLS.pop(key, None) if reuse else None
            spare = None
            if pool is not None and (not pool.alive() or pool.pg_timeout_s < timeout_s + 60):
                pool.close()
                pool = None
            started = pool is None
            pg_timeout_s = pg_timeout_for(timeout_s) if reuse else timeout_s + 60
            if pool is None:
                spare_key = standby.spare_key(world_size, accelerator, gpus, not reuse)
                spare = standby.pop_spare(spare_key, pg_timeout_s)
        if pool is None:
            t0 = time.monotonic()
            pool = standby.started_spare(spare)
            STATS["from_standby"] += pool is not None
            pool = pool or start_pool(world_size, accelerator, gpus, pg_timeout_s)
            STATS["pools"] += 1
            STATS["waited_s"] += time.monotonic() - t0
            if not reuse:
                # A fresh-process call is often followed by another (save, then load in new
                # processes): its replacement starts now. Held off during measurements.
                with TABLES_LOCK:
                    standby.start_spare(world_size, accelerator, gpus, fresh=True)
        healthy = False
        try:
            replies = send_and_collect(pool, fn, call, timeout_s)
            healthy = replies_healthy(replies)
            return resolve(replies)
        finally:
            # Anything else (an exception, a timeout, Ctrl-C) leaves ranks mid-call: never reuse.
            if not healthy:
                pool.kill()
            elif not reuse:
                pool.close()
            with TABLES_LOCK:
                if healthy and reuse:
                    POOLS[key] = pool
                    while len(POOLS) > MAX_POOLS:
                        POOLS.popitem(last=False)[1].close()
                if reuse and (started or not healthy):
                    # After the call, not during it: the replacement must not share the node
                    # with what the call measured. (A fresh-process call started its own before.)
                    standby.start_spare(world_size, accelerator, gpus)


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
    world_size must equal the job's size or be None/-1 ("whatever the job has").
    """
    check_timeout(timeout_s)
    kwargs = dict(kwargs or {})
    if external_rendezvous():
        return run_external(fn, world_size, timeout_s, tuple(args), kwargs, accelerator)
    check_world_size(world_size)
    return _run_spawned(fn, world_size, float(timeout_s), tuple(args), kwargs,
                        check_accelerator(accelerator), reuse)
