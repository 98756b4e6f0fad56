"""Lanes (run_concurrently): independent calls at once, a plain worker pool over the rank
groups of dsconform.harness.groups: L lanes per world size, one-rank lanes on every GPU in turn;
a failure kills only its own lane's ranks. Cell batches (dsconform.plugin.batch) use them from a
background thread while the main thread runs other tests; they never run beside a
measurement."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsconform import settings
from dsconform.harness import output
from dsconform.harness.api import run_ranks
from dsconform.harness.errors import check_accelerator, check_timeout, check_world_size, resolve
from dsconform.harness.groups import GROUPS
from dsconform.harness.launcher import external_rendezvous
from dsconform.harness.pool import gpus_for, pg_timeout_for, pickle_call, replies_healthy
from dsconform.harness.xdist import InsufficientGPUs, worker_gpus

LANE_KINDS = ("lane", "lane-fresh")


def close_lanes() -> None:
    """Stop the idle lane groups (a cell batch that ended: its lanes' CUDA contexts and memory
    must not stay on the GPUs through the measurements that follow)."""
    GROUPS.drop(LANE_KINDS)


#: How many groups per world size run_concurrently spreads independent calls over ("lanes");
#: "auto": LANES_AUTO on cuda machines with at least LANES_MIN_CORES cores (LANES_ONE_GPU on a
#: worker with one GPU), else 1 (every call in turn, as run_ranks); DSCONFORM_LANES=N forces N.
#: Why these counts: docs/performance.md#lanes-and-ops.
LANES = settings.get("DSCONFORM_LANES")
LANES_AUTO = 3
LANES_MIN_CORES = 16
LANES_ONE_GPU = 9

#: How often a lane with no ready entry looks again (an op build it waits for has ended).
READY_POLL_S = 0.25


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
    return LANES_ONE_GPU if len(worker_gpus()) == 1 else LANES_AUTO


def _lane_keys(world_size: int, accelerator: str, count: int) -> list[tuple]:
    """The pool keys of count lanes: one-rank lanes go round this worker's GPUs, wider ones all
    use the first world_size GPUs (their processes share them)."""
    gpus = gpus_for(world_size, accelerator)  # raises InsufficientGPUs
    if accelerator == "cuda" and world_size == 1:
        mine = worker_gpus()
        return [(1, accelerator, (mine[i % len(mine)],)) for i in range(count)]
    return [(world_size, accelerator, gpus)] * count


def _lane_threads() -> int:
    """CPU threads per lane rank: the cores shared by every lane of one- and two-rank calls
    (9 ranks with 3 lanes; 9 one-rank lanes on one GPU), so CPU Adam in several lanes at once
    does not oversubscribe them."""
    lanes = lanes_for()
    ranks = lanes if lanes == LANES_ONE_GPU and len(worker_gpus()) == 1 else 3 * lanes
    return max(1, (os.cpu_count() or 1) // ranks)


def start_lanes(world_sizes: list[int], accelerator: str = "cuda",
                lanes: int | None = None) -> int:
    """Keep lane groups for these world sizes started (a GPU run calls this at collection's
    end); returns how many were started. Nothing starts while quiet, or with one lane."""
    lanes = lanes_for(accelerator) if lanes is None else lanes
    if lanes <= 1:
        return 0
    started = 0
    for ws in world_sizes:
        try:
            keys = _lane_keys(ws, accelerator, lanes)
        except InsufficientGPUs:
            continue
        for key in dict.fromkeys(keys):
            started += GROUPS.keep((*key, "lane"), keys.count(key), threads=_lane_threads())
    return started


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


def _take(queue: deque, lock: threading.Lock, ready: Callable[[int], bool] | None,
          cancel: threading.Event) -> int | None:
    """The first entry of the queue that is ready (all of them without ready()), taken off it;
    while none is, wait; None once the queue is empty or the run is cancelled."""
    while not cancel.is_set():
        with lock:
            if not queue:
                return None
            i = next((i for i in queue if ready is None or ready(i)), None)
            if i is not None:
                queue.remove(i)
                return i
        cancel.wait(READY_POLL_S)
    return None


def _lane(key: tuple, queue: deque, lock: threading.Lock, calls: list, pickled: list,
          finish: Callable[[int, tuple, float], None], cancel: threading.Event,
          context: tuple[list, dict], labels: list[str | None],
          before: Callable[[int], None] | None = None,
          ready: Callable[[int], bool] | None = None) -> None:
    """One lane: take calls of its world size off the shared queue until none is left. The
    steps of an entry run in turn on one group; a fresh step on new ranks that ran no call (of
    another world size, if it says so: that group is not kept as a lane's)."""
    threads = _lane_threads()
    while (i := _take(queue, lock, ready, cancel)) is not None:
        # The ranks' output of this call is logged as its cell's test (output.record).
        with output.labelled(labels[i] or output.current_label()):
            steps = _steps(calls[i])
            pool = None
            healthy = True
            t0 = time.monotonic()
            try:
                if before is not None:
                    before(i)
                results = []
                for j, (step, payload) in enumerate(zip(steps, pickled[i])):
                    need = pg_timeout_for(step.timeout_s)
                    if pool is not None and (step.fresh or pool.pg_timeout_s < need):
                        GROUPS.release(pool, True, None)
                        pool = None
                    if pool is None:
                        kind = "lane-fresh" if step.fresh else "lane"
                        pool = GROUPS.lease(_key_of(key, step, i), (kind,), kind, need, cancel,
                                            threads)
                    if j + 1 < len(steps) and steps[j + 1].fresh:  # its ranks start meanwhile
                        ahead = (*_key_of(key, steps[j + 1], i), "lane-fresh")
                        GROUPS.keep(ahead, len(GROUPS.idle(ahead)) + 1, threads=threads,
                                    remember=False)
                    healthy = False
                    replies = pool.call(step.fn, payload, step.timeout_s, context)
                    healthy = replies_healthy(replies)
                    results.append(resolve(replies))
                outcome: tuple = ("ok", results if isinstance(calls[i], list) else results[0])
            except BaseException as exc:  # the call's own outcome, raised in its test
                outcome = ("raise", exc)
            finally:
                with GROUPS.lock:
                    GROUPS.stats["lane_calls"] += len(steps)
                if pool is not None:  # another size's ranks are not kept as a lane's
                    healthy = healthy and not cancel.is_set()
                    GROUPS.release(pool, healthy,
                                   "lane" if healthy and pool.world_size == key[0] else None)
            if cancel.is_set():  # stopped from outside: what the kill did is no outcome
                return
            finish(i, outcome, time.monotonic() - t0)


def run_concurrently(calls: list[RankCall | list[RankCall]], *, lanes: int | None = None,
                     on_done: Callable[[int, tuple, float], None] | None = None,
                     cancel: threading.Event | None = None,
                     labels: list[str] | None = None,
                     before: Callable[[int], None] | None = None,
                     ready: Callable[[int], bool] | None = None) -> list[tuple]:
    """Run independent calls at once over `lanes` groups per world size (one-rank groups on
    every GPU in turn), in their order; with one lane, under torchrun/Slurm or for a single call,
    in turn through run_ranks. Each outcome is ("ok", the per-rank results) or ("raise", what
    run_ranks would have raised for that call alone); a failing call kills only its lane's ranks.
    An entry may be a list of steps run in turn on one lane (fresh=True: on new processes,
    started during the step before, maybe of another world size); its outcome lists each step's
    results. On lanes, calls see sys.path and the environment as at this call (through
    run_ranks: as each call starts). on_done(index, outcome, seconds since its lane took it)
    runs as each call ends; labels: what each call's rank output is logged as (default: the test
    running then); before(index): run by the lane before that entry; ready(index): whether an
    entry may start now (a lane takes the first ready one and waits while none is). cancel:
    setting it kills every lane's ranks, and unfinished calls get no outcome (None) and no
    on_done; Ctrl-C kills every lane and re-raises."""
    outcomes: list = [None] * len(calls)
    lanes = lanes_for() if lanes is None else lanes
    labels = list(labels) if labels is not None else [None] * len(calls)

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
    context = (list(sys.path), dict(os.environ))
    threads = []
    for (ws, accel), indices in groups.items():
        try:
            keys = _lane_keys(ws, accel, min(lanes, len(indices)))
        except InsufficientGPUs as exc:
            for i in indices:
                finish(i, ("raise", exc))
            continue
        queue, lock = deque(indices), threading.Lock()
        threads += [threading.Thread(target=_lane, name=f"dsconform-lane-ws{ws}", daemon=True,
                                     args=(key, queue, lock, calls, pickled, finish, cancel,
                                           context, labels, before, ready)) for key in keys]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive() and not cancel.is_set():
                t.join(0.05)
    finally:
        if cancel.is_set() or any(t.is_alive() for t in threads):  # stopped, or Ctrl-C
            cancel.set()
            GROUPS.kill_leased(cancel)
            for t in threads:
                t.join(15)
    return outcomes
