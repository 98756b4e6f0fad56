"""Lanes (run_concurrently): independent calls at once over several pools per world size,
one-rank pools on every GPU in turn; a failure kills only its own lane's ranks. Cell batches
(dsconform.plugin.batch) use them from a background thread while the main thread runs other
tests (their run_ranks calls and the lanes only share the pool tables' lock); they never run
beside a measurement."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsconform import settings
from dsconform.harness import output, standby
from dsconform.harness.api import run_ranks
from dsconform.harness.errors import (
    RankError,
    check_accelerator,
    check_timeout,
    check_world_size,
    resolve,
)
from dsconform.harness.launcher import external_rendezvous
from dsconform.harness.pool import (
    LANE_POOLS,
    LANE_STATS,
    LANE_STATS_LOCK,
    POOL_PG_TIMEOUT_S,
    TABLES_LOCK,
    Pool,
    await_start,
    clear_build_locks,
    close_idle,
    gpus_for,
    my_gpus,
    pg_timeout_for,
    pickle_call,
    replies_healthy,
    send_and_collect,
)
from dsconform.harness.xdist import InsufficientGPUs


def close_lanes() -> None:
    """Stop the idle lane pools (a cell batch that ended: its lanes' CUDA contexts and memory
    must not stay on the GPUs through the measurements that follow)."""
    with TABLES_LOCK:
        idle = [p for pools in LANE_POOLS.values() for p in pools]
        LANE_POOLS.clear()
    close_idle(idle)


#: How many pools per world size run_concurrently spreads independent calls over ("lanes");
#: one-rank lanes take the GPUs in turn. "auto": LANES_AUTO on cuda machines with at least
#: LANES_MIN_CORES cores, else 1 (every call in turn, as run_ranks). DSCONFORM_LANES=N forces N.
#: Correctness cells are latency-bound (Python, kernel launches, engine set-up): a 2xH200 node
#: runs several at once in about the time of one.
LANES = settings.get("DSCONFORM_LANES")


#: 3, not 4: on 2xH200 the batch took as long with 3 lanes per world size as with 4 (42.5 s
#: and 43.7 s, one machine, warm), and fewer ranks starting at once left the other tests less
#: to wait for (15 s against 21 s of rank start-up waited; the tier 77 s against 83 s).
LANES_AUTO = 3


LANES_MIN_CORES = 16


#: Lanes on a worker with one GPU, where only one-rank lanes run: the 9 ranks that 3 lanes of
#: one- and two-rank calls hold on a two-GPU node. 1xH200, warm acceptance tier: 81 s with 3
#: lanes, 75 s with 6, 69 s with 9 (results/reference/h200-x1/ds-0.19.8/speed/lanes.txt).
LANES_ONE_GPU = 9


@dataclass(frozen=True)
class RankCall:
    """One run_ranks call, to be run with others by run_concurrently. fresh: run it on new
    processes that ran no call and built no warm-up engine (run_ranks(reuse=False)): the
    second step of a save-then-resume-in-new-processes cell."""

    fn: Callable
    world_size: int
    timeout_s: float
    args: tuple = ()
    kwargs: dict | None = None
    accelerator: str | None = None
    fresh: bool = False


def _steps(entry: RankCall | list[RankCall]) -> tuple[RankCall, ...]:
    return (entry,) if isinstance(entry, RankCall) else tuple(entry)


def run_steps(entry: RankCall | list[RankCall]) -> Any:
    """One run_concurrently entry through run_ranks here: a call's per-rank results, or for a
    list of steps, one after another (a fresh step on new processes), the list of theirs."""
    _check_steps(_steps(entry))
    results = [run_ranks(c.fn, c.world_size, timeout_s=c.timeout_s, args=c.args,
                         kwargs=c.kwargs, accelerator=c.accelerator, reuse=not c.fresh)
               for c in _steps(entry)]
    return results if isinstance(entry, list) else results[0]


def lanes_for(accelerator: str | None = None) -> int:
    """The number of lanes run_concurrently uses by default here (DSCONFORM_LANES)."""
    if LANES not in ("", "auto"):
        try:
            return max(1, int(LANES))
        except ValueError:
            raise ValueError(f"DSCONFORM_LANES must be 'auto' or a number, got {LANES!r}") from None
    if check_accelerator(accelerator) != "cuda" or (os.cpu_count() or 1) < LANES_MIN_CORES:
        return 1
    return LANES_ONE_GPU if len(my_gpus()[3]) == 1 else LANES_AUTO


def _lane_keys(world_size: int, accelerator: str, count: int) -> list[tuple]:
    """The pool keys of count lanes: one-rank lanes go round this worker's GPUs, wider ones all
    use the first world_size GPUs (their processes share them)."""
    gpus = gpus_for(world_size, accelerator)  # raises InsufficientGPUs
    if accelerator == "cuda" and world_size == 1:
        mine = my_gpus()[3]
        return [(1, accelerator, (mine[i % len(mine)],)) for i in range(count)]
    return [(world_size, accelerator, gpus)] * count


def _lane_threads() -> int:
    """CPU threads per lane rank: the cores shared by every lane of one- and two-rank calls
    (9 ranks with 3 lanes; 9 one-rank lanes on one GPU), so CPU Adam in several lanes at once
    does not oversubscribe them."""
    lanes = lanes_for()
    ranks = lanes if lanes == LANES_ONE_GPU and len(my_gpus()[3]) == 1 else 3 * lanes
    return max(1, (os.cpu_count() or 1) // ranks)


def _new_lane(key: tuple, pg_timeout_s: float, fresh: bool = False) -> Pool:
    """Start (without waiting) a lane pool; call with TABLES_LOCK held. fresh: for a fresh step, so
    never warmed up (as run_ranks' fresh-process standby ranks)."""
    clear_build_locks()
    LANE_STATS["started"] += 1
    return Pool(key[0], key[1], key[2], pg_timeout_s, warm=standby.RANK_WARMUP and not fresh,
                primed=standby.RANK_WARMUP and fresh, threads=_lane_threads(),
                label="(lane ranks starting)")


def start_lanes(world_sizes: list[int], accelerator: str = "cuda",
                lanes: int | None = None) -> int:
    """Start lane pools for these world sizes now, in the background (a GPU run calls this at
    collection, so they start while ops build); returns how many were started. Nothing starts
    while a measurement holds standby ranks (hold_spares), or with one lane."""
    lanes = lanes_for(accelerator) if lanes is None else lanes
    started = 0
    if lanes <= 1:
        return 0
    with TABLES_LOCK:
        if standby.held():
            return 0
        for ws in world_sizes:
            try:
                keys = _lane_keys(ws, accelerator, lanes)
            except InsufficientGPUs:
                continue
            for key in set(keys):
                idle = LANE_POOLS.setdefault(key, [])
                while len(idle) < keys.count(key):
                    try:
                        idle.append(_new_lane(key, POOL_PG_TIMEOUT_S))
                    except Exception as exc:  # an optimisation: calls start their own
                        output.record(output.current_label(), "dsconform.harness",
                                      f"lane ranks not started ({exc})")
                        return started
                    started += 1
    return started


class _Spawner:
    """Starts lane pools for lane threads from the thread that runs the batch. Ranks die with
    the *thread* that started them (PR_SET_PDEATHSIG, harness.rank._exit_when_orphaned): a pool a
    lane thread started itself would be killed when that thread ends, and its idle ranks with it.
    The batch's thread calls serve() while it waits for the lanes."""

    def __init__(self) -> None:
        self.requests: deque = deque()
        self.lock = threading.Lock()

    def new_lane(self, key: tuple, pg_timeout_s: float, cancel: threading.Event,
                 fresh: bool = False) -> Pool:
        done = threading.Event()
        slot: list = []
        with self.lock:
            self.requests.append((key, pg_timeout_s, fresh, slot, done))
        while not done.wait(0.05):
            if cancel.is_set():
                raise RankError("the batch was interrupted before this lane's ranks started")
        if isinstance(slot[0], BaseException):
            raise slot[0]
        return slot[0]

    def serve(self) -> None:
        while True:
            with self.lock:
                if not self.requests:
                    return
                key, pg_timeout_s, fresh, slot, done = self.requests.popleft()
            try:
                with TABLES_LOCK:
                    slot.append(_new_lane(key, pg_timeout_s, fresh))
            except BaseException as exc:  # the lane's call reports it
                slot.append(exc)
            done.set()


def _lane_pool(key: tuple, pg_timeout_s: float, spawner: _Spawner,
               cancel: threading.Event, fresh: bool = False,
               started: Pool | None = None, active: set | None = None) -> Pool:
    """An idle lane pool for key, else a new one; fresh: always a new one, never warmed up
    (started: one started ahead for it). Started up (RankError if it cannot start). While it
    starts it is in ``active``, so a batch stopped meanwhile kills it instead of waiting for
    its start-up."""
    pool = started
    with TABLES_LOCK:
        idle = LANE_POOLS.get(key, [])
        while idle and pool is None and not fresh:
            pool = idle.pop()
            if pool.closed or pool.pg_timeout_s < pg_timeout_s:
                pool.kill()
                pool = None
    if pool is None:
        pool = spawner.new_lane(key, pg_timeout_s, cancel, fresh)
    if active is not None:
        active.add(pool)
    if cancel.is_set():  # stopped while it was being handed over
        pool.kill()
    t0 = time.monotonic()
    try:
        return await_start(pool)
    except RankError:
        if active is not None:
            active.discard(pool)
        raise
    finally:
        with LANE_STATS_LOCK:
            LANE_STATS["waited_s"] += time.monotonic() - t0


def _key_of(lane_key: tuple, step: RankCall, index: int = 0) -> tuple:
    """The pool key a step runs on: its lane's, or for a fresh step of another world size a
    pool key of that size, one-rank ones taking the GPUs in turn by entry index
    (InsufficientGPUs if the node has too few)."""
    if step.world_size == lane_key[0]:
        return lane_key
    return _lane_keys(step.world_size, lane_key[1], index + 1)[index]


def _check_steps(steps: tuple[RankCall, ...]) -> str:
    """The entry's accelerator; ValueError for steps that cannot run in turn on one lane: every
    step shares the accelerator, and only a fresh step (new ranks anyway) changes world size."""
    if not steps:
        raise ValueError("an entry of run_concurrently has no steps")
    accels = {check_accelerator(step.accelerator) for step in steps}
    if len(accels) > 1:
        raise ValueError("the steps of one entry must share their accelerator")
    for before, step in zip(steps, steps[1:]):
        if step.world_size != before.world_size and not step.fresh:
            raise ValueError(f"a step of world size {step.world_size} after one of "
                             f"{before.world_size}: only a fresh step (fresh=True, new ranks) "
                             "may change the world size")
    return accels.pop()


class _Queue:
    """The calls of one world size, shared by its lanes, with op affinity: loading a DeepSpeed
    op costs each process seconds (async_io 2.5 s, cpu_adam about 2 s on 1xH200 beside a
    batch: DeepSpeed's builder compiles a libaio probe, runs ninja and imports the module),
    once per rank. Each op gets at most as many lanes as its share of the work (by ``costs``)
    calls for (``limits``): a lane whose ranks loaded an op takes the calls that need it
    first; a lane that loaded none of them claims one while the op has lanes to spare, so the
    op's calls start early on their lanes instead of being left to every lane at the end; the
    calls that need no op go to the others. ``ops``: each call's ops (empty: none, or not
    known); ``ready(ops)``: whether those ops can be loaded now (not still being built by the
    run: a rank that loads an op first would build it itself, unseen by the build scheduler);
    the order of ``indices`` stands otherwise."""

    WAIT = -1  # take(): calls are left, but none is ready

    def __init__(self, indices: list[int], ops: list[frozenset[str]],
                 costs: list[float], lanes: int,
                 ready: Callable[[frozenset[str]], bool] | None = None) -> None:
        self.order = deque(indices)
        self.ops = ops
        self.ready = ready or (lambda _ops: True)
        self.lock = threading.Lock()
        self.claims: dict[str, set[int]] = {}
        total = sum(costs[i] for i in indices) or 1.0
        self.limits: dict[str, int] = {}
        for op in sorted({op for i in indices for op in ops[i]}):
            share = sum(costs[i] for i in indices if op in ops[i]) / total
            self.limits[op] = max(1, math.ceil(lanes * share))

    def __bool__(self) -> bool:
        with self.lock:
            return bool(self.order)

    def _spare(self, op: str, lane: int) -> bool:
        claimed = self.claims.get(op, ())
        return lane in claimed or len(claimed) < self.limits[op]

    def take(self, lane: int, loaded: set[str]) -> int | None:
        """The next call for a lane whose ranks have ``loaded`` these ops; None: none left;
        WAIT: none of those left is ready yet."""
        with self.lock:
            if not self.order:
                return None
            ready = [i for i in self.order if self.ready(self.ops[i])]
            if not ready:
                return self.WAIT
            pick = next((i for i in ready if self.ops[i] and self.ops[i] <= loaded), None)
            if pick is None:  # claim an op that has lanes to spare
                pick = next((i for i in ready if self.ops[i] - loaded and all(
                    self._spare(op, lane) for op in self.ops[i] - loaded)), None)
            if pick is None:  # what needs nothing this lane has not loaded
                pick = next((i for i in ready if self.ops[i] <= loaded), None)
            if pick is None:  # nothing else is left: better than waiting
                pick = ready[0]
            self.order.remove(pick)
            for op in self.ops[pick]:
                self.claims.setdefault(op, set()).add(lane)
            return pick


def _lane(key: tuple, lane: int, queue: _Queue, calls: list, pickled: list, outcomes: list,
          active: set, cancel: threading.Event, spawner: _Spawner,
          on_done: Callable[[int, tuple, float], None] | None,
          context: tuple[list, dict], labels: list[str | None]) -> None:
    """One lane: take calls of its world size off the shared queue until none is left; an
    entry of several steps runs them in turn, a fresh step on ranks that ran no call (of
    another world size, if it says so: that pool is not kept for the lane)."""
    pool: Pool | None = None
    ahead: Pool | None = None  # started while the step before a fresh step runs
    loaded: set[str] = set()  # the ops the lane's ranks loaded (queue.ops of calls they ran)
    try:
        while not cancel.is_set():
            i = queue.take(lane, loaded)
            if i is None:
                return
            if i == queue.WAIT:  # the ops of every call left are still being built
                time.sleep(0.2)
                continue
            # The ranks' output of this call is logged as its cell's test (output.record).
            with output.labelled(labels[i] or output.current_label()):
                steps = _steps(calls[i])
                healthy = True
                t0 = time.monotonic()
                try:
                    results = []
                    for j, (step, payload) in enumerate(zip(steps, pickled[i])):
                        need = pg_timeout_for(step.timeout_s)
                        if pool is not None and (not pool.alive() or pool.pg_timeout_s < need
                                                 or step.fresh):
                            active.discard(pool)
                            pool.close()
                            pool = None
                        if pool is None:
                            pool, ahead = _lane_pool(_key_of(key, step, i), need, spawner, cancel,
                                                     active=active,
                                                     fresh=step.fresh, started=ahead), None
                            active.add(pool)
                            loaded = set()
                        if j + 1 < len(steps) and steps[j + 1].fresh and ahead is None:
                            ahead = spawner.new_lane(_key_of(key, steps[j + 1], i),
                                                     pg_timeout_for(steps[j + 1].timeout_s),
                                                     cancel, fresh=True)
                            active.add(ahead)
                        healthy = False
                        replies = send_and_collect(pool, step.fn, payload, step.timeout_s, context)
                        healthy = replies_healthy(replies)
                        if pool.world_size == key[0]:
                            loaded |= queue.ops[i]
                        results.append(resolve(replies))
                    outcome: tuple = ("ok", results if isinstance(calls[i], list) else results[0])
                except BaseException as exc:  # the call's own outcome, raised in its test
                    outcome = ("raise", exc)
                finally:
                    with LANE_STATS_LOCK:
                        LANE_STATS["calls"] += len(steps)
                    if not healthy and pool is not None:
                        pool.kill()
                        active.discard(pool)
                        pool = None
                    if ahead is not None:  # a step before the fresh one failed: not needed
                        ahead.kill()
                        active.discard(ahead)
                        ahead = None
                    if pool is not None and pool.world_size != key[0]:  # another size's ranks
                        active.discard(pool)
                        pool.close()
                        pool = None
                if cancel.is_set():  # stopped from outside: what the kill did is no outcome
                    return
                outcomes[i] = outcome
                if on_done is not None:
                    on_done(i, outcome, time.monotonic() - t0)
    finally:
        if pool is not None:
            active.discard(pool)
            if cancel.is_set() or not pool.alive():
                pool.kill()
            else:
                with TABLES_LOCK:
                    LANE_POOLS.setdefault(key, []).append(pool)


def run_concurrently(calls: list[RankCall | list[RankCall]], *, lanes: int | None = None,
                     on_done: Callable[[int, tuple, float], None] | None = None,
                     cancel: threading.Event | None = None,
                     labels: list[str] | None = None,
                     ops: list[list[str]] | None = None,
                     costs: list[float] | None = None,
                     ready: Callable[[frozenset[str]], bool] | None = None) -> list[tuple]:
    """Run independent calls at once, spread over `lanes` pools per world size (one-rank pools
    on every GPU in turn). Each outcome is ("ok", the per-rank results) or ("raise", the
    exception run_ranks would have raised for that call alone: RankError, RankTimeout, a
    unanimous skip, InsufficientGPUs...). A failing call kills only its own lane's ranks; that
    lane starts new ones for its next call. on_done(index, outcome, seconds) runs as each call
    ends (seconds: from taking the call, its lane's start-up included).

    On lanes, the calls see sys.path and the environment as they were when run_concurrently
    was called, whatever the calling process changes meanwhile (it may run other tests: a
    background batch); through run_ranks (one lane) they see them as each call starts.
    cancel: setting it stops the batch from another thread: every lane's ranks are killed, the
    calls not finished get no outcome (None) and no on_done.

    With one lane, under torchrun/Slurm, or for a single call, the calls run one after another
    through run_ranks. Ctrl-C kills every lane and re-raises.

    An entry may be a list of steps (RankCalls of one accelerator): they run in turn on one
    lane, a step with fresh=True on new processes (started while the step before it runs),
    which may be of another world size (a save on 2 ranks, the load on 1); the outcome is
    ("ok", the list of each step's per-rank results), or the first failing step's exception.

    labels: what each call's rank output is logged as (its test's node id,
    dsconform.harness.output); default: the test running when each call starts.

    ops: the DeepSpeed ops each call loads, costs: about how long each takes (seconds): the
    calls that need an op gather on as few lanes as their share of the work allows, so that
    fewer processes pay for loading it; ready(ops): whether those ops can be loaded now (a
    call waits while they are still being built) (_Queue)."""
    outcomes: list = [None] * len(calls)
    lanes = lanes_for() if lanes is None else lanes
    labels = list(labels) if labels is not None else [None] * len(calls)
    call_ops = [frozenset(o) for o in ops] if ops is not None else [frozenset()] * len(calls)
    call_costs = list(costs) if costs is not None else [1.0] * len(calls)

    def finish(i: int, outcome: tuple, seconds: float = 0.0) -> None:
        outcomes[i] = outcome
        if on_done is not None:
            on_done(i, outcome, seconds)

    if lanes <= 1 or len(calls) < 2 or external_rendezvous():
        for i, c in enumerate(calls):
            if cancel is not None and cancel.is_set():
                break
            t0 = time.monotonic()
            try:
                with output.labelled(labels[i] or output.current_label()):
                    outcome: tuple = ("ok", run_steps(c))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # the call's own outcome (a skip too)
                outcome = ("raise", exc)
            finish(i, outcome, time.monotonic() - t0)
        return outcomes
    groups: OrderedDict[tuple, list[int]] = OrderedDict()
    pickled: list = [None] * len(calls)
    for i, c in enumerate(calls):
        try:  # what run_ranks would refuse, each call's own outcome
            steps = _steps(c)
            for step in steps:
                check_world_size(step.world_size)
                check_timeout(step.timeout_s)
            accel = _check_steps(steps)
            pickled[i] = [pickle_call(step.fn, tuple(step.args), dict(step.kwargs or {}))
                          for step in steps]
        except Exception as exc:
            finish(i, ("raise", exc))
            continue
        groups.setdefault((steps[0].world_size, accel), []).append(i)
    cancel = threading.Event() if cancel is None else cancel
    active, spawner = set(), _Spawner()
    context = (list(sys.path), dict(os.environ))
    threads = []
    for (ws, accel), indices in groups.items():
        try:
            keys = _lane_keys(ws, accel, min(lanes, len(indices)))
        except InsufficientGPUs as exc:
            for i in indices:
                finish(i, ("raise", exc))
            continue
        queue = _Queue(indices, call_ops, call_costs, len(keys), ready)
        for lane, key in enumerate(keys):
            threads.append(threading.Thread(
                target=_lane, name=f"dsconform-lane-ws{ws}",
                args=(key, lane, queue, calls, pickled, outcomes, active, cancel, spawner,
                      on_done, context, labels),
                daemon=True))
    for t in threads:
        t.start()
    def stop() -> None:
        cancel.set()
        for pool in list(active):
            pool.kill()
        for t in threads:
            t.join(15)

    try:
        for t in threads:
            while t.is_alive():
                if cancel.is_set():
                    stop()
                    return outcomes
                spawner.serve()
                t.join(0.05)
    except BaseException:
        stop()
        raise
    return outcomes
