"""The one owner of this process's rank groups (dsconform.harness.pool.Pool): one table of
every idle and busy group, one lock, one starter. lease() and release() a group for a call;
keep(key, n) keeps n idle groups of a key started ahead (standby ranks, lanes); quiet() starts
nothing while a measurement runs. One thread starts every group: a rank dies with the *thread*
that started it (PR_SET_PDEATHSIG, harness.rank._exit_when_orphaned), and a lane's thread ends
with its batch."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from queue import SimpleQueue

from dsconform import settings
from dsconform.harness import output
from dsconform.harness.errors import RankError
from dsconform.harness.pool import POOL_PG_TIMEOUT_S, Pool, clear_build_locks, close_pools
from dsconform.harness.rank import RANK_OWNED_ENV

#: Groups of the "pooled" kind (ranks that ran a call, kept for the next) alive at once, the
#: least recently used closed first; on GPUs each rank holds a CUDA context.
MAX_POOLS = settings.get("DSCONFORM_MAX_POOLS")

#: Standby ranks: "auto" keeps them for cuda on machines with at least SPARE_MIN_CORES cores
#: (on 2 cores the extra start-up slows the test it overlaps); "1"/"0" force it.
SPARE_POOLS = settings.get("DSCONFORM_SPARE_POOLS")
SPARE_MIN_CORES = 8

#: Whether standby and lane ranks build and destroy a tiny engine before they report ready
#: (rank.warm_up); those for fresh-process calls import what it would instead (rank.prime).
RANK_WARMUP = settings.get("DSCONFORM_RANK_WARMUP")

#: Kinds of group: "plain" (a call's own new ranks), "pooled" (ran a run_ranks call), standby
#: ranks "standby" (warmed) and "fresh" (primed), and the same for lanes, "lane"/"lane-fresh".
STANDBY_KINDS = ("standby", "fresh")

#: Variables that change between tests by themselves and say nothing about a test's setup.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def spares_enabled(accelerator: str) -> bool:
    """Whether standby ranks are kept for this accelerator (DSCONFORM_SPARE_POOLS)."""
    if settings.is_off(SPARE_POOLS):
        return False
    if settings.is_on(SPARE_POOLS):
        return True
    return accelerator == "cuda" and (os.cpu_count() or 1) >= SPARE_MIN_CORES


class RankGroups:
    """Every rank group of this process. A key is (world size, accelerator, GPUs, kind)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: group -> [key, holder]: holder None while idle, else who leased it (a batch's
        #: cancel event, or a call's token), in the order groups were last given back.
        self.table: dict[Pool, list] = {}
        self.targets: dict[tuple, int] = {}  # keep(): idle groups wanted per key
        self.quiet_depth = 0
        self.env: dict[str, str] | None = None  # the environment standby ranks started in
        self.requests: SimpleQueue = SimpleQueue()
        self.starter: threading.Thread | None = None
        self.stats = {"pools": 0, "from_standby": 0, "waited_s": 0.0,
                      "lanes": 0, "lane_calls": 0, "lane_waited_s": 0.0}
        self.phases: list[dict[str, float]] = []

    # -- the starter ------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            key, pg_timeout_s, threads, label, future = self.requests.get()
            try:
                with output.labelled(label):
                    clear_build_locks()
                    future.set_result(Pool(
                        key[0], key[1], key[2], pg_timeout_s, threads=threads, label=label,
                        warm=RANK_WARMUP and key[3] in ("standby", "lane"),
                        primed=RANK_WARMUP and key[3] in ("fresh", "lane-fresh")))
            except BaseException as exc:  # the caller raises or logs it
                future.set_exception(exc)

    def _start(self, key: tuple, pg_timeout_s: float, holder: object, label: str,
               threads: int | None = None) -> Pool:
        """A new group of key (its ranks started, not yet ready), entered in the table."""
        future: Future = Future()
        with self.lock:
            if self.starter is None or not self.starter.is_alive():
                self.starter = threading.Thread(target=self._serve, daemon=True,
                                                name="dsconform-rank-starter")
                self.starter.start()
        self.requests.put((key, pg_timeout_s, threads, label, future))
        pool = future.result()
        with self.lock:
            self.table[pool] = [key, holder]
            if key[3].startswith("lane"):
                self.stats["lanes"] += 1
        return pool

    # -- leases -----------------------------------------------------------------------------
    def _take_idle(self, base: tuple, kinds: tuple[str, ...], pg_timeout_s: float,
                   holder: object) -> tuple[Pool | None, str | None]:
        """An idle group of base and the first of these kinds that has one, leased to holder
        (call with the lock held); dead or too-short-timeout groups met are killed."""
        for kind in kinds:
            for pool, (k, h) in list(self.table.items()):
                if k != (*base, kind) or h is not None:
                    continue
                if pool.closed or pool.pg_timeout_s < pg_timeout_s or \
                        (pool.ready and not pool.alive()):
                    del self.table[pool]
                    pool.kill()
                    continue
                self.table[pool][1] = holder
                return pool, kind
        return None, None

    def lease(self, base: tuple, kinds: tuple[str, ...], new_kind: str, pg_timeout_s: float,
              holder: object, threads: int | None = None) -> Pool:
        """A started-up group for a call on base (world size, accelerator, GPUs): an idle one
        of these kinds (in this order), else a new one of new_kind. A standby group that
        fails to start is logged and replaced by new ranks, which report a real start-up
        failure (RankError)."""
        t0 = time.monotonic()
        lanes = new_kind.startswith("lane")
        with self.lock:
            pool, taken = self._take_idle(base, kinds, pg_timeout_s, holder)
        try:
            if pool is not None and not pool.ready:
                try:
                    self._ready(pool)
                except RankError as exc:
                    self.forget(pool)
                    output.record(output.current_label(), "dsconform.harness",
                                  f"standby ranks failed to start, starting new ones ({exc})")
                    pool, taken = None, None
            if pool is None:
                pool = self._start((*base, new_kind), pg_timeout_s, holder,
                                   output.current_label(), threads)
                self._ready(pool)
        except BaseException:
            if pool is not None:
                pool.kill()
                self.forget(pool)
            raise
        finally:
            with self.lock:
                key = "lane_waited_s" if lanes else "waited_s"
                self.stats[key] += time.monotonic() - t0 if taken != "pooled" else 0.0
                if not lanes and taken != "pooled":
                    self.stats["pools"] += 1
                    self.stats["from_standby"] += taken in STANDBY_KINDS
        return pool

    def _ready(self, pool: Pool) -> None:
        pool.start_up()
        with self.lock:
            self.phases.extend(pool.phases)
            pool.phases = []

    def release(self, pool: Pool, healthy: bool, keep_as: str | None) -> None:
        """Give a leased group back: kept idle as keep_as (at the end of the table), else
        asked to exit; killed when the call was not healthy (its ranks mid-call)."""
        if not healthy or pool.closed:
            pool.kill()
            keep_as = None
        old: list[Pool] = []
        with self.lock:
            entry = self.table.pop(pool, None)
            if entry is None:  # shut down meanwhile
                keep_as = None
            if keep_as is not None:
                self.table[pool] = [(*entry[0][:3], keep_as), None]
                pooled = [p for p, (k, h) in self.table.items() if k[3] == "pooled" and h is None]
                old = pooled[:max(0, len(pooled) - MAX_POOLS)]
                for p in old:
                    del self.table[p]
        close_pools(old + ([pool] if keep_as is None else []))

    def forget(self, pool: Pool) -> None:
        with self.lock:
            self.table.pop(pool, None)

    def kill_leased(self, holder: object) -> None:
        """Kill the groups leased by holder (a batch stopped from another thread)."""
        with self.lock:
            mine = [p for p, (_, h) in self.table.items() if h is holder]
        for pool in mine:
            pool.kill()

    # -- kept warm --------------------------------------------------------------------------
    def idle(self, key: tuple) -> list[Pool]:
        with self.lock:
            return [p for p, (k, h) in self.table.items() if k == key and h is None]

    def keep(self, key: tuple, n: int, *, threads: int | None = None,
             remember: bool = True) -> int:
        """Start groups of key, without waiting for them, until n are idle; returns how many
        it started. Nothing starts while quiet (remember: start them when the quiet ends),
        nor, for standby kinds, in an environment other than the first one's (a test's
        monkeypatch in force must not be baked into processes another test uses)."""
        with self.lock:
            if remember:
                self.targets[key] = max(n, self.targets.get(key, 0))
            if self.quiet_depth:
                return 0
            if key[3] in STANDBY_KINDS:
                env = {k: v for k, v in os.environ.items()
                       if k not in RANK_OWNED_ENV and k not in _VOLATILE_ENV}
                if self.env is None:
                    self.env = env
                elif env != self.env:
                    return 0
            missing = n - len(self.idle(key))
        started = 0
        for _ in range(missing):
            try:
                self._start(key, POOL_PG_TIMEOUT_S, None, f"({key[3]} ranks starting)", threads)
            except Exception as exc:  # an optimisation: calls start their own
                output.record(output.current_label(), "dsconform.harness",
                              f"{key[3]} ranks not started ({exc})")
                break
            started += 1
        return started

    def drop(self, kinds: tuple[str, ...]) -> None:
        """Close the idle groups of these kinds and forget keeping them."""
        with self.lock:
            idle = [p for p, (k, h) in self.table.items() if k[3] in kinds and h is None]
            for p in idle:
                del self.table[p]
            self.targets = {k: n for k, n in self.targets.items() if k[3] not in kinds}
        close_pools(idle)

    def settle(self) -> None:
        """Wait until every idle group has started (those that fail are dropped)."""
        for pool in [p for p, (_, h) in list(self.table.items()) if h is None]:
            try:
                self._ready(pool)
            except RankError:
                self.forget(pool)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Nothing starts up meanwhile; idle groups still starting are stopped."""
        with self.lock:
            self.quiet_depth += 1
            starting = [p for p, (_, h) in self.table.items()
                        if h is None and not p.started_now()]
            for p in starting:
                del self.table[p]
        for p in starting:
            p.kill()
        try:
            yield
        finally:
            with self.lock:
                self.quiet_depth -= 1
                targets = dict(self.targets) if self.quiet_depth == 0 else {}
            for key, n in targets.items():
                self.keep(key, n, remember=False)

    def shutdown(self) -> None:
        """Stop every group, idle or leased, all at once."""
        with self.lock:
            pools = list(self.table)
            self.table.clear()
            self.targets.clear()
        close_pools(pools)

    def startup_phases(self) -> tuple[int, dict[str, float]]:
        """How many ranks started here, and each start-up phase's median seconds over the
        ranks that had it, in the order of a start-up."""
        with self.lock:
            phases = list(self.phases)
        order = dict.fromkeys(k for ph in phases for k in ph)
        return len(phases), {k: statistics.median(ph[k] for ph in phases if k in ph)
                             for k in order}


#: This process's owner of rank groups.
GROUPS = RankGroups()
