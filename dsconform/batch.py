"""Cell batches: the rank calls of many selected cells run at once, each checked by its own test.

A correctness cell (ZeRO against DDP, a checkpoint round trip, a loss-scaling run) spends most of
its second on Python, kernel launches and engine set-up, not on the GPUs. A test function marked
``@batched(plan)`` hands its rank call to the run's cell batch: when the first such test of the
run is reached, every selected, runnable cell of every batched test function still to come is
planned (``plan(params, workdir, run) -> RankCall``) and run through
``dsconform.dist.run_concurrently`` (several rank pools per world size; one-rank cells on every
GPU in turn). Each test then takes its own outcome with ``cell_results(request)`` and checks it
exactly as it would have checked a run_ranks call: the same results, the same RankError,
RankTimeout or skip, raised in that test, and the same tolerance and known-issue handling.

What it changes:
* The time: the first batched test of the run carries the batch's wall time (``--durations``
  and junit show it there); the summary prints the batch (cells, lanes, seconds).
* Nothing runs at the same time as a measuring test: the batch starts and ends inside one test.
* Cells that the gate will skip, or fail as a broken promise, are left out of the batch and
  take their usual path.
* A cell's plan gets a directory of its own under --scratch (``workdir``), removed as soon as
  its call ends, instead of the test's ``scratch`` fixture.

Batches are off (every cell runs its call in its own test, as before) with one lane
(``DSCONFORM_LANES``, "auto": only on cuda machines with >= 16 cores), under pytest-xdist
(another worker may own a cell) and under torchrun/Slurm.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dsconform import dist, gating
from dsconform.dist import RankCall
from dsconform.runstate import RunState, run_state

__all__ = ["Plan", "RankCall", "batch_stats", "batched", "cell_results", "enabled", "has_plan"]

#: plan(params, workdir, run) -> the cell's RankCall, or (RankCall, cleanup) where cleanup() runs
#: once the call ended (a directory of its own on an NVMe path). params: the cell's parametrize
#: values (item.callspec.params); workdir: a fresh directory under --scratch, removed after the
#: call (the test's ``scratch`` when the cell runs alone); run: this run's RunState. An exception
#: it raises (a preflight refusal, a skip) is the cell's outcome.
Plan = Callable[[dict, Path, RunState], "RankCall | tuple[RankCall, Callable[[], Any]]"]
_PLAN_ATTR = "_dsconform_batch_plan"
#: The user property (junit.xml) holding a batched cell's call seconds, its lane's wait included.
BATCH_SECONDS = "dsconform_batch_seconds"


def batched(plan: Plan, *, cost: float = 1.0) -> Callable:
    """Decorate a parametrized test whose body gets its rank results from cell_results().
    cost: about how long one cell's call takes (seconds on a GPU node); a batch starts the
    costliest cells first, so that no long cell is left to run alone at the end."""
    def decorate(fn: Callable) -> Callable:
        setattr(fn, _PLAN_ATTR, (plan, float(cost)))
        return fn
    return decorate


def _batched_of(item: pytest.Item) -> tuple[Plan, float] | None:
    return getattr(getattr(item, "function", None), _PLAN_ATTR, None)


def _plan_of(item: pytest.Item) -> Plan | None:
    found = _batched_of(item)
    return found[0] if found is not None else None


def has_plan(item: pytest.Item) -> bool:
    """Whether the item is a cell of a batched test."""
    return _plan_of(item) is not None


@dataclass
class _State:
    outcomes: dict[str, tuple] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # each batched cell's call
    seen: set[str] = field(default_factory=set)  # cells a batch already decided about
    batches: list[dict] = field(default_factory=list)


_STATE = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State:
    if _STATE not in config.stash:
        config.stash[_STATE] = _State()
    return config.stash[_STATE]


def batch_stats(config: pytest.Config) -> list[dict]:
    """Each batch run so far: cells, lanes, seconds, the test that carried it."""
    return list(_state(config).batches)


def enabled(rs: RunState) -> bool:
    """Whether this run batches cells (lanes > 1, not under xdist or torchrun/Slurm)."""
    if dist.xdist_worker()[1] > 1 or dist.external_rendezvous():
        return False
    accel = "cuda" if rs.node.gpu_count else "cpu"
    return dist.lanes_for(accel) > 1


def _will_run(item: pytest.Item, rs: RunState) -> bool:
    """Whether the item's call phase will run its body: no skip or skipif that applies, no
    xfail(run=False), and a gate that neither skips nor reports a broken promise."""
    from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

    try:
        if evaluate_skip_marks(item) is not None:
            return False
        xfail = evaluate_xfail_marks(item)
        if xfail is not None and not xfail.run:
            return False
    except Exception:  # noqa: BLE001 - a mark pytest cannot evaluate: let the test report it
        return False
    verdict = gating.item_verdict(item, rs)
    return verdict is None or (verdict.ok and not verdict.broken_promises)


def _split(planned: Any) -> tuple[RankCall, Callable[[], Any] | None]:
    if isinstance(planned, tuple):
        return planned[0], planned[1]
    return planned, None


def _waits_for_build(item: pytest.Item, rs: RunState) -> bool:
    """Whether the cell needs an op that this run's parallel builds have not finished."""
    builds = rs.op_builds
    if builds is None:
        return False
    return any(not builds.finished(op) for op in gating.item_ops(item))


def _params(item: pytest.Item) -> dict:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def _run_batch(item: pytest.Item, rs: RunState, state: _State) -> None:
    items = item.session.items
    start = next((i for i, it in enumerate(items) if it is item), len(items))
    cells = [it for it in items[start:] if _plan_of(it) is not None
             and it.nodeid not in state.seen and _will_run(it, rs)]
    state.seen.update(it.nodeid for it in cells)
    state.seen.add(item.nodeid)
    if len(cells) < 2:
        return
    # Cells that load an op still building (cold cache) last: the others run meanwhile; the
    # costliest first otherwise.
    cells.sort(key=lambda it: (_waits_for_build(it, rs), -_batched_of(it)[1]))
    calls: list[RankCall] = []
    owners: list[tuple[pytest.Item, Path, Callable[[], Any] | None]] = []
    for it in cells:
        workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=rs.scratch))
        try:
            call, cleanup = _split(_plan_of(it)(_params(it), workdir, rs))
        except (KeyboardInterrupt, SystemExit):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        except BaseException as exc:  # noqa: BLE001 - e.g. a preflight refusal: the cell's outcome
            state.outcomes[it.nodeid] = ("raise", exc)
            shutil.rmtree(workdir, ignore_errors=True)
            continue
        calls.append(call)
        owners.append((it, workdir, cleanup))

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
        state.outcomes[nodeid] = outcome
        state.seconds[nodeid] = seconds
        release(index)

    lanes = dist.lanes_for("cuda" if rs.node.gpu_count else "cpu")
    t0 = time.monotonic()
    try:
        dist.run_concurrently(calls, lanes=lanes, on_done=done)
    finally:
        for index in range(len(owners)):
            release(index)
    tests = sorted({it.originalname for it, _, _ in owners})
    took = sorted(((state.seconds.get(it.nodeid, 0.0), it.nodeid) for it, _, _ in owners),
                  reverse=True)
    state.batches.append({"cells": len(calls), "lanes": lanes,
                          "seconds": round(time.monotonic() - t0, 1),
                          "carried_by": item.nodeid, "tests": tests,
                          "longest": [(round(sec, 1), nodeid) for sec, nodeid in took[:5]],
                          "cell_seconds": round(sum(sec for sec, _ in took), 1)})


def cell_results(request: pytest.FixtureRequest, workdir: Path | str | None = None) -> Any:
    """This cell's per-rank results (what run_ranks returns), from the run's cell batch; raises
    what its call raised. Not batched (batches off, or the only cell): the call runs here, with
    workdir (the test's ``scratch``) as its directory."""
    item = request.node
    plan = _plan_of(item)
    if plan is None:
        raise TypeError(f"{item.name}: cell_results() needs the test decorated with @batched(plan)")
    rs = run_state(item.config)
    state = _state(item.config)
    if item.nodeid not in state.seen and enabled(rs):
        _run_batch(item, rs, state)
    outcome = state.outcomes.pop(item.nodeid, None)
    if item.nodeid in state.seconds:  # in junit.xml: what this cell's call took in the batch
        item.user_properties.append((BATCH_SECONDS, round(state.seconds.pop(item.nodeid), 2)))
    if outcome is None:
        call, cleanup = _split(plan(_params(item),
                                    Path(workdir if workdir is not None else rs.scratch), rs))
        try:
            return dist.run_ranks(call.fn, call.world_size, timeout_s=call.timeout_s,
                                  args=call.args, kwargs=call.kwargs, accelerator=call.accelerator)
        finally:
            if cleanup is not None:
                cleanup()
    kind, value = outcome
    if kind == "raise":
        raise value
    return value
