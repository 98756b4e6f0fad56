"""Cell batches: the rank calls of many selected cells run at once, each checked by its own test
(docs/performance.md#what-the-acceptance-tiers-time-goes-to-2xh200).

A test function marked ``@batched(plan)`` hands its rank call to the run's cell batch: once
collection ends, every selected cell the gate will run is planned (``plan(params, workdir, run)
-> RankCall``) and the calls start in a background thread on the lanes
(``dsconform.harness.lanes.run_concurrently``), with the environment of the end of collection.
Each test takes its outcome with ``cell_results(request)`` and checks it as it would a run_ranks
call's: the same results, RankError, RankTimeout or skip. The tests that neither are batched nor
measure run first, beside the batch; then the batched ones; then those that measure, each after
the whole batch (``wait_for_batch``). Batches are off with one lane (``DSCONFORM_LANES``), under
pytest-xdist and under torchrun/Slurm; a session that ends early stops the batch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dsconform.gate import requires as gating
from dsconform.harness.lanes import RankCall, close_lanes, lanes_for, run_concurrently, run_steps
from dsconform.harness.launcher import external_rendezvous
from dsconform.harness.xdist import xdist_worker
from dsconform.plugin.runstate import RunState, run_state
from dsconform.results.records import BATCH_SECONDS

#: plan(params, workdir, run) -> the cell's RankCall, or a list of RankCalls (steps run in turn on
#: one lane, a fresh=True step on new processes; the cell's results are then the list of each
#: step's), or either with a cleanup, (calls, cleanup), run once the call ended. params: the
#: cell's parametrize values; workdir: a fresh directory under --scratch, removed after the call
#: (the test's ``scratch`` when the cell runs alone); run: this run's RunState. An exception it
#: raises (a preflight refusal, a skip) is the cell's outcome.
Plan = Callable[[dict, Path, RunState],
                "RankCall | list[RankCall] | tuple[RankCall | list[RankCall], Callable[[], Any]]"]
_PLAN_ATTR = "_dsconform_batch_plan"
#: The user property holding the seconds a test waited for the background batch (its cell, or,
#: for a measuring test, the whole batch).
BATCH_WAIT = "dsconform_batch_wait_seconds"


def batched(plan: Plan, *, where: Callable[[dict], bool] | None = None) -> Callable:
    """Decorate a parametrized test whose body gets its rank results from cell_results().
    where: which cells are batched, from their parametrize values (default all); the body of
    the others makes its own calls and must not call cell_results()."""
    def decorate(fn: Callable) -> Callable:
        setattr(fn, _PLAN_ATTR, (plan, where))
        return fn
    return decorate


def _plan_of(item: pytest.Item) -> Plan | None:
    found = getattr(getattr(item, "function", None), _PLAN_ATTR, None)
    if found is None or (found[1] is not None and not found[1](_params(item))):
        return None
    return found[0]


def has_plan(item: pytest.Item) -> bool:
    """Whether the item is a cell of a batched test."""
    return _plan_of(item) is not None


@dataclass
class _State:
    outcomes: dict[str, tuple] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # each batched cell's call
    members: set[str] = field(default_factory=set)  # cells of the background batch
    pending: set[str] = field(default_factory=set)  # members whose call has not ended
    batches: list[dict] = field(default_factory=list)
    waits: list[tuple[float, str]] = field(default_factory=list)  # (seconds, test) waiting for it
    cond: threading.Condition = field(default_factory=threading.Condition)
    cancel: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    finished: bool = False  # the batch's thread has handed over every outcome and closed lanes


_STATE = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State:
    return config.stash.setdefault(_STATE, _State())


def batch_stats(config: pytest.Config) -> list[dict]:
    """Each batch run so far: cells, lanes, seconds, the tests that waited for it."""
    state = _state(config)
    with state.cond:
        return [dict(b, waited_s=round(sum(w for w, _ in state.waits), 1),
                     longest_wait=max(state.waits, default=None))
                for b in state.batches]


def lane_count(rs: RunState) -> int:
    """Lanes per world size on this run's accelerator (DSCONFORM_LANES)."""
    return lanes_for("cuda" if rs.node.gpu_count else "cpu")


def enabled(rs: RunState) -> bool:
    """Whether this run batches cells (lanes > 1, not under xdist or torchrun/Slurm)."""
    return xdist_worker()[1] <= 1 and not external_rendezvous() and lane_count(rs) > 1


def measures(item: pytest.Item) -> bool:
    """Whether the test records values with the ``metrics`` fixture in its own process or
    ranks (a batched cell's values come from the batch): it must have the node to itself."""
    return "metrics" in getattr(item, "fixturenames", ()) and not has_plan(item)


def _shares_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) or {}
    return any(getattr(d[-1], "scope", "function") in ("module", "class", "package")
               for d in defs.values() if d)


def phases(items: list[pytest.Item]) -> dict[int, int]:
    """Where each item goes in a run with a background batch, by id(item): the tests that
    neither are batched nor measure run while the batch does, 0 those that load no op, then 1
    those that do (each waits for its ops' builds); 2 batched cells (their outcomes are ready,
    or soon); 3 measuring tests (after the batch, on a quiet node). The
    items of a module with a module-scoped fixture (the ops suite's ds_report and op checks)
    stay together, at the latest phase among them, so that fixture is set up once."""
    phase = {id(it): 3 if measures(it) else 2 if has_plan(it) else int(bool(gating.item_ops(it)))
             for it in items}
    shared = {str(it.fspath) for it in items if _shares_module_fixture(it)}
    latest: dict[str, int] = {}
    for it in items:
        latest[str(it.fspath)] = max(latest.get(str(it.fspath), 0), phase[id(it)])
    for it in items:
        if str(it.fspath) in shared:
            phase[id(it)] = latest[str(it.fspath)]
    return phase


def _will_run(item: pytest.Item, rs: RunState) -> bool:
    """Whether its body will run: no skip, xfail(run=False), gate skip or broken promise."""
    from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

    try:
        if evaluate_skip_marks(item) is not None:
            return False
        xfail = evaluate_xfail_marks(item)
        if xfail is not None and not xfail.run:
            return False
    except Exception:  # a mark pytest cannot evaluate: let the test report it
        return False
    verdict = rs.verdict(item)
    return verdict is None or (verdict.ok and not verdict.broken_promises)


def _split(planned: Any) -> tuple[RankCall | list[RankCall], Callable[[], Any] | None]:
    return (planned[0], planned[1]) if isinstance(planned, tuple) else (planned, None)


def _params(item: pytest.Item) -> dict:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def select(session: pytest.Session, rs: RunState) -> list[pytest.Item]:
    """The selected cells the gate will run: what start() batches."""
    return [it for it in session.items if _plan_of(it) is not None and _will_run(it, rs)]


def start(session: pytest.Session, rs: RunState, cells: list[pytest.Item]) -> int:
    """Plan select()'s ``cells`` and start their calls in a background thread (the plugin calls
    this once collection ends, with batches enabled); returns how many cells it started."""
    state = _state(session.config)
    if len(cells) < 2:
        return 0
    # Cells that load an op still building (cold cache) last, the rest running meanwhile.
    cells = sorted(cells, key=lambda it: rs.op_builds is not None and not all(
        rs.op_builds.finished(op) for op in gating.item_ops(it)))
    calls: list[RankCall | list[RankCall]] = []
    owners: list[tuple[pytest.Item, Path, Callable[[], Any] | None]] = []
    for it in cells:
        state.members.add(it.nodeid)
        workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=rs.scratch))
        try:
            call, cleanup = _split(_plan_of(it)(_params(it), workdir, rs))
        except (KeyboardInterrupt, SystemExit):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        except BaseException as exc:  # e.g. a preflight refusal: the cell's outcome
            state.outcomes[it.nodeid] = ("raise", exc)
            shutil.rmtree(workdir, ignore_errors=True)
            continue
        calls.append(call)
        owners.append((it, workdir, cleanup))
        state.pending.add(it.nodeid)
    lanes = lane_count(rs)
    builds = rs.op_builds
    ops = [gating.item_ops(it) if builds is not None else [] for it, _, _ in owners]

    def ready(index: int) -> bool:
        """Whether the cell's ops are built: lanes run ready cells while the others wait."""
        return all(builds.finished(op) for op in ops[index])

    def before(index: int) -> None:
        """A rank that loads an op the run still builds would wait for the build's lock, or
        build it itself, unseen by the build scheduler: the cell waits for the build."""
        for op in ops[index]:
            builds.wait(op)

    state.thread = threading.Thread(target=_run,
                                    args=(state, calls, owners, lanes, before, ready),
                                    name="dsconform-cell-batch", daemon=True)
    state.thread.start()
    return len(calls)


def _run(state: _State, calls: list[RankCall | list[RankCall]],
         owners: list[tuple[pytest.Item, Path, Callable[[], Any] | None]], lanes: int,
         before: Callable[[int], None], ready: Callable[[int], bool]) -> None:
    """The batch's thread: run the calls, hand each outcome to its test as it ends."""
    t0 = time.monotonic()

    def release(index: int) -> None:
        it, workdir, cleanup = owners[index]
        owners[index] = (it, workdir, None)
        try:
            if cleanup is not None:
                cleanup()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def done(index: int, outcome: tuple, seconds: float) -> None:
        nodeid = owners[index][0].nodeid
        try:
            release(index)
        except Exception as exc:  # a cleanup that fails is the cell's failure
            if outcome[0] == "ok":
                outcome = ("raise", exc)
        with state.cond:
            state.outcomes[nodeid] = outcome
            state.seconds[nodeid] = seconds
            state.pending.discard(nodeid)
            state.cond.notify_all()

    try:
        # Each call's rank output is logged as its cell's test (dsconform.harness.output).
        run_concurrently(calls, lanes=lanes, on_done=done, cancel=state.cancel,
                         labels=[it.nodeid for it, _, _ in owners], before=before,
                         ready=ready)
    except BaseException as exc:  # the harness failed: each waiting cell says so
        with state.cond:
            for it, _, _ in owners:
                if it.nodeid in state.pending:
                    state.outcomes[it.nodeid] = ("raise", RuntimeError(
                        f"the cell batch stopped before this cell's call ended: {exc!r}"))
    finally:
        for index in range(len(owners)):
            with contextlib.suppress(Exception):  # the session goes on; the directory stays
                release(index)
        close_lanes()
        # The cells' writes go to the disk now, not during the measurement that comes next
        # (docs/performance.md#what-the-acceptance-tiers-time-goes-to-2xh200).
        t_sync = time.monotonic()
        if hasattr(os, "sync"):
            os.sync()
        sync_s = time.monotonic() - t_sync
        took = sorted(((state.seconds.get(it.nodeid, 0.0), it.nodeid) for it, _, _ in owners),
                      reverse=True)
        with state.cond:
            state.batches.append({
                "cells": len(calls), "lanes": lanes, "seconds": round(time.monotonic() - t0, 1),
                "tests": sorted({it.originalname for it, _, _ in owners}),
                "longest": [(round(sec, 1), nodeid) for sec, nodeid in took[:5]],
                "cell_seconds": round(sum(sec for sec, _ in took), 1),
                # Stopped early: cancelled with cells left (a session that ends right after its
                # last cell's test also cancels, while the lanes close).
                "stopped": state.cancel.is_set() and bool(state.pending),
                "sync_seconds": round(sync_s, 1)})
            state.pending.clear()  # a stopped batch: the cells left run in their own tests
            state.finished = True
            state.cond.notify_all()


def in_batch(item: pytest.Item) -> bool:
    """Whether the item's cell is (or was) in this run's background batch."""
    return item.nodeid in _state(item.config).members


def _wait(item: pytest.Item, ready: Callable[[_State], bool]) -> float:
    state = _state(item.config)
    t0 = time.monotonic()
    with state.cond:
        while not ready(state):
            state.cond.wait(0.5)  # a timeout, so Ctrl-C reaches the main thread
        waited = time.monotonic() - t0
        if waited >= 0.05:
            state.waits.append((round(waited, 1), item.nodeid))
    if waited >= 0.05:
        item.user_properties.append((BATCH_WAIT, round(waited, 2)))
    return waited


def wait_for_batch(item: pytest.Item) -> float:
    """Wait until the background batch has ended (a measuring test: nothing else may run on
    the node while it measures); returns the seconds waited, also in junit.xml as
    dsconform_batch_wait_seconds."""
    return 0.0 if _state(item.config).thread is None else _wait(item, lambda s: s.finished)


def stop(config: pytest.Config) -> None:
    """Stop a batch still running (the session ends early: -x, Ctrl-C): kill its lanes' ranks."""
    state = config.stash.get(_STATE, None)
    if state is None or state.thread is None:
        return
    state.cancel.set()
    state.thread.join(30)


def cell_results(request: pytest.FixtureRequest, workdir: Path | str | None = None) -> Any:
    """This cell's per-rank results (what run_ranks returns), from the run's cell batch; raises
    what its call raised. Waits for the call if the batch has not reached its end yet. Not
    batched (batches off, or the only cell): the call runs here, with workdir (the test's
    ``scratch``) as its directory."""
    item = request.node
    if (plan := _plan_of(item)) is None:
        raise TypeError(f"{item.name}: cell_results() needs the test decorated with @batched(plan)")
    rs = run_state(item.config)
    state = _state(item.config)
    nodeid = item.nodeid
    if nodeid in state.members:
        _wait(item, lambda s: nodeid in s.outcomes or nodeid not in s.pending)
    with state.cond:
        outcome = state.outcomes.pop(nodeid, None)
        seconds = state.seconds.get(nodeid)
    if seconds is not None:  # in junit.xml: what this cell's call took in the batch
        item.user_properties.append((BATCH_SECONDS, round(seconds, 2)))
    if outcome is None:
        call, cleanup = _split(plan(_params(item),
                                    Path(workdir if workdir is not None else rs.scratch), rs))
        try:
            return run_steps(call)
        finally:
            if cleanup is not None:
                cleanup()
    kind, value = outcome
    if kind == "raise":
        raise value
    return value
