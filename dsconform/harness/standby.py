"""Standby ranks ("spares"): another set of ranks per pool key, started in the background on
cuda machines with enough cores, so a call that needs new processes does not wait for a CUDA
context, deepspeed and NCCL. Those for pooled calls also warm up (rank.warm_up); a
fresh-process call (reuse=False) only takes ranks that never built an engine. While a
measurement holds them (hold_spares), nothing starts up."""

from __future__ import annotations

import os

from dsconform import settings
from dsconform.harness import output
from dsconform.harness.errors import RankError
from dsconform.harness.pool import (
    LANE_POOLS,
    POOL_PG_TIMEOUT_S,
    TABLES_LOCK,
    Pool,
    await_start,
    clear_build_locks,
    gpus_for,
)
from dsconform.harness.rank import RANK_OWNED_ENV
from dsconform.harness.xdist import InsufficientGPUs

#: Standby pools ("spares"): once a pool has been started for a (world size, accelerator, GPUs)
#: key, a second set of ranks for that key is started in the background, so the next call that
#: needs new processes (a fresh-process test, or the call after a failure killed the pool) finds
#: them imported and initialised instead of paying 8-20 s for a CUDA context, deepspeed and NCCL
#: (2xH200). A spare has never run a test function, so it is as fresh as a new spawn. "auto":
#: cuda pools on machines with at least SPARE_MIN_CORES cores (on 2 CPU cores the extra start-up
#: would slow the test it overlaps); "1"/"0" force it.
SPARE_POOLS = settings.get("DSCONFORM_SPARE_POOLS")


SPARE_MIN_CORES = 8


#: Whether standby ranks build and destroy a tiny engine before they report ready
#: (harness.rank.warm_up); DSCONFORM_RANK_WARMUP=0 turns it off.
RANK_WARMUP = settings.get("DSCONFORM_RANK_WARMUP")


#: Standby pools by (world size, accelerator, GPUs, warmed up). Warmed-up ones serve pooled
#: calls; a fresh-process call (reuse=False) only ever takes ranks that never built an engine, so
#: "loads in a fresh process" keeps its meaning.
SPARES: dict[tuple, Pool] = {}


_HOLD = 0  # > 0 while a measurement runs (hold_spares): no spare starts then


_SPARE_ENV: dict[str, str] | None = None  # the environment spares are started in


def held() -> bool:
    """Whether a measurement holds the standby ranks now (nothing may start up)."""
    return _HOLD > 0


def spares_enabled(accelerator: str) -> bool:
    """Whether standby pools are kept for this accelerator (DSCONFORM_SPARE_POOLS)."""
    if settings.is_off(SPARE_POOLS):
        return False
    if settings.is_on(SPARE_POOLS):
        return True
    return accelerator == "cuda" and (os.cpu_count() or 1) >= SPARE_MIN_CORES


#: Variables that change between tests by themselves and say nothing about a test's setup.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in RANK_OWNED_ENV and k not in _VOLATILE_ENV}


def spare_key(world_size: int, accelerator: str, gpus: tuple[str, ...], fresh: bool) -> tuple:
    return (world_size, accelerator, gpus, RANK_WARMUP and not fresh)


def start_spare(world_size: int, accelerator: str, gpus: tuple[str, ...], *,
                 fresh: bool = False) -> None:
    """Start (without waiting) a standby pool for this key unless one exists, a measurement is
    running, or the environment differs from the one the first spare saw (a test's
    monkeypatch is in force: its variables must not be baked into processes another test uses).
    fresh: for fresh-process calls, so never warmed up."""
    global _SPARE_ENV
    key = spare_key(world_size, accelerator, gpus, fresh)
    if _HOLD or key in SPARES or not spares_enabled(accelerator):
        return
    env = _plain_env()
    if _SPARE_ENV is None:
        _SPARE_ENV = env
    elif env != _SPARE_ENV:
        return
    try:
        clear_build_locks()
        # Standby ranks for pooled calls also build a first engine (harness.rank.warm_up): nobody
        # waits for them.
        # Those for fresh-process calls only import what a first engine would (rank.prime).
        SPARES[key] = Pool(world_size, accelerator, gpus, POOL_PG_TIMEOUT_S, warm=key[3],
                           primed=RANK_WARMUP and fresh, label="(standby ranks starting)")
    except Exception as exc:  # a spare is an optimisation: the call will spawn
        output.record(output.current_label(), "dsconform.harness",
                      f"standby ranks not started ({exc})")


def pop_spare(key: tuple, pg_timeout_s: float) -> Pool | None:
    """Take the standby pool for key out of the table (call with TABLES_LOCK held), or None (none
    kept, or one that cannot serve this call)."""
    pool = SPARES.pop(key, None)
    if pool is None:
        return None
    if pool.pg_timeout_s < pg_timeout_s or pool.closed:
        pool.kill()
        return None
    return pool


def started_spare(pool: Pool | None) -> Pool | None:
    """A taken standby pool once started up, or None (none, or it failed to start: the caller
    then starts ranks the usual way, which reports a real start-up failure). Waits without
    TABLES_LOCK held."""
    if pool is None:
        return None
    try:
        return await_start(pool)
    except RankError as exc:
        output.record(output.current_label(), "dsconform.harness",
                      f"standby ranks failed to start, starting new ones ({exc})")
        return None


def start_spares(world_sizes: list[int], accelerator: str = "cuda", *,
                 fresh: bool = False) -> list[tuple]:
    """Start standby pools for these world sizes now (a run starting on a GPU node calls this
    so rank start-up overlaps collection and op builds; fresh: the never-warmed ones that
    fresh-process calls take). Returns the keys started; world sizes this xdist worker has too
    few GPUs for are left out."""
    started = []
    with TABLES_LOCK:
        for ws in world_sizes:
            try:
                gpus = gpus_for(ws, accelerator)
            except InsufficientGPUs:
                continue
            start_spare(ws, accelerator, gpus, fresh=fresh)
            if spare_key(ws, accelerator, gpus, fresh) in SPARES:
                started.append((ws, accelerator, gpus))
    return started


def settle_spares() -> None:
    """Wait until every standby pool has finished starting (or drop those that failed), so
    nothing else starts up on the node while a measurement runs."""
    with TABLES_LOCK:
        for key, pool in list(SPARES.items()):
            try:
                await_start(pool)
            except RankError:
                SPARES.pop(key, None)
        for pools in LANE_POOLS.values():  # idle lane pools still starting (start_lanes)
            for pool in list(pools):
                try:
                    await_start(pool)
                except RankError:
                    pools.remove(pool)


def _started_now(pool: Pool) -> bool:
    """Whether a starting pool has started by now (every rank answered), without waiting."""
    if pool.ready:
        return True
    if not all(conn.poll() for conn in pool.conns):
        return False
    try:
        await_start(pool)
    except RankError:
        return False  # killed by await_start
    return True


#: Standby keys (world size, accelerator, GPUs, fresh) whose starting pools a hold stopped; they
#: start again when the last hold ends.
_STOPPED: list[tuple] = []


def _stop_starting() -> None:
    """Kill the standby and idle lane pools still starting (call with TABLES_LOCK held). Standby
    pools are started again when the hold ends; lanes are started by the next batch that needs
    them."""
    for key, pool in list(SPARES.items()):
        if not _started_now(pool):
            pool.kill()
            del SPARES[key]
            _STOPPED.append((key[0], key[1], key[2], not key[3]))
    for pools in LANE_POOLS.values():
        for pool in list(pools):
            if not _started_now(pool):
                pool.kill()
                pools.remove(pool)


class hold_spares:  # used like a function: `with hold_spares():`
    """While in force no standby or lane pool starts, and those still starting are stopped (the
    standby ones start again when the hold ends): a performance measurement must not share the
    node with a starting rank (CPU, a CUDA context, NCCL set-up), and waiting for them cost
    12 s before a measurement on 2xH200. The metrics fixture holds them for the whole test."""

    def __enter__(self) -> hold_spares:
        global _HOLD
        with TABLES_LOCK:
            _HOLD += 1
            _stop_starting()
        return self

    def __exit__(self, *exc: object) -> None:
        global _HOLD
        with TABLES_LOCK:
            _HOLD -= 1
            if _HOLD == 0:
                while _STOPPED:
                    ws, accel, gpus, fresh = _STOPPED.pop(0)
                    start_spare(ws, accel, gpus, fresh=fresh)
