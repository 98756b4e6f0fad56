"""Standby ranks (dsconform.harness.groups, kind "standby"/"fresh"): fresh processes without
waiting for them.

Run on the CPU accelerator with spares forced on (on this 2-core machine "auto" leaves them off).
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from dsconform.harness import api as dist
from dsconform.harness import groups
from dsconform.harness.groups import GROUPS

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.harness.test_dist import assert_no_leftovers


def assert_no_leftovers_of(pids: list[int]) -> None:
    for pid in pids:
        assert not psutil.pid_exists(pid), f"rank process {pid} is still alive (or unreaped)"

TIMEOUT_S = 60.0


@pytest.fixture
def spares(monkeypatch):
    """Spares on, and no pool or spare left from an earlier test (nor after this one)."""
    dist.shutdown_pools()
    monkeypatch.setattr(groups, "SPARE_POOLS", "1")
    monkeypatch.setattr(GROUPS, "env", None)
    yield
    dist.shutdown_pools()
    assert_no_leftovers()


def _key(ws: int = 2) -> tuple:
    return (ws, "cpu", ())


def _spare(ws: int = 2, *, fresh: bool = False):
    """The standby pool for pooled calls (fresh: for fresh-process calls), or None."""
    idle = GROUPS.idle((ws, "cpu", (), "fresh" if fresh else "standby"))
    assert len(idle) <= 1, idle
    return idle[0] if idle else None


def _spare_pids(ws: int = 2, *, fresh: bool = False) -> list[int]:
    return list(_spare(ws, fresh=fresh).pids)


def _any_spare(ws: int) -> bool:
    return _spare(ws) is not None or _spare(ws, fresh=True) is not None


def test_auto_keeps_spares_for_cuda_on_big_machines_only(monkeypatch):
    monkeypatch.setattr(groups, "SPARE_POOLS", "auto")
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert dist.spares_enabled("cuda") and not dist.spares_enabled("cpu")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert not dist.spares_enabled("cuda")
    monkeypatch.setattr(groups, "SPARE_POOLS", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert not dist.spares_enabled("cuda")


def test_fresh_calls_get_new_processes_that_ran_nothing(spares):
    first = dist.run_ranks(rank_fns.pid_and_calls, 2, timeout_s=TIMEOUT_S, reuse=False,
                           accelerator="cpu")
    assert [calls for _, calls in first] == [1, 1]
    standby = _spare_pids(fresh=True)  # started as the first call began
    dist.settle_spares()  # its start-up (imports ahead included, rank.prime) is not timed
    t0 = time.monotonic()
    second = dist.run_ranks(rank_fns.pid_and_calls, 2, timeout_s=TIMEOUT_S, reuse=False,
                            accelerator="cpu")
    took = time.monotonic() - t0
    assert [p for p, _ in second] == standby, "the second fresh call did not use the spare"
    assert [calls for _, calls in second] == [1, 1], "a spare had run a function before"
    assert not {p for p, _ in first} & {p for p, _ in second}
    assert not any(psutil.pid_exists(p) for p, _ in first), "fresh ranks left running"
    # The third set is already starting.
    assert _spare(fresh=True) is not None
    assert took < 10, f"a call on a started spare took {took:.1f} s"


def test_failure_is_replaced_by_a_spare(spares):
    pooled = dist.run_ranks(rank_fns.pid, 2, timeout_s=TIMEOUT_S, accelerator="cpu")
    standby = _spare_pids()  # started after the pool's first call
    with pytest.raises(dist.RankError):
        dist.run_ranks(rank_fns.raise_on, 2, args=(1,), timeout_s=TIMEOUT_S, accelerator="cpu")
    after = dist.run_ranks(rank_fns.pid, 2, timeout_s=TIMEOUT_S, accelerator="cpu")
    assert after == standby and not set(after) & set(pooled)


def test_a_dead_spare_is_replaced_by_new_ranks(spares):
    dist.run_ranks(rank_fns.pid, 2, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    dead = _spare_pids(fresh=True)
    for p in dead:
        psutil.Process(p).kill()
    out = dist.run_ranks(rank_fns.pid_and_calls, 2, timeout_s=TIMEOUT_S, reuse=False,
                         accelerator="cpu")
    assert not {p for p, _ in out} & set(dead)
    assert [calls for _, calls in out] == [1, 1]


def test_no_spare_starts_while_held_and_held_stops_starting_ones(spares):
    """A hold kills the standby ranks still starting (nothing starts up beside a measurement,
    and the measurement does not wait for them), keeps those that are ready, and starts the
    stopped ones again when it ends."""
    dist.run_ranks(rank_fns.pid, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    starting = _spare(1, fresh=True)
    assert starting is not None and not starting.ready
    dist.start_spares([2], "cpu")
    dist.settle_spares()
    ready = _spare_pids(2)
    dist.run_ranks(rank_fns.pid, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    starting = _spare(1, fresh=True)
    assert starting is not None and not starting.ready
    t0 = time.monotonic()
    with dist.hold_spares():
        assert time.monotonic() - t0 < 1.0, "the hold waited for the starting standby ranks"
        assert _spare(1, fresh=True) is None and starting.closed
        assert_no_leftovers_of(starting.pids)
        assert _spare_pids(2) == ready, "the hold stopped standby ranks that were ready"
        dist.run_ranks(rank_fns.pid, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
        assert _spare(1, fresh=True) is None, "a spare started during a measurement"
    assert _spare(1, fresh=True) is not None, "the stopped standby ranks were not started again"


def test_no_spare_is_started_in_a_tests_changed_environment(spares, monkeypatch):
    dist.run_ranks(rank_fns.pid, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    dist.shutdown_pools()
    monkeypatch.setenv("DSCONFORM_TEST_SPARE_ENV", "x")
    dist.run_ranks(rank_fns.pid, 1, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    assert not _any_spare(1)


def test_start_spares_and_shutdown_leave_nothing(spares):
    assert dist.start_spares([1, 2], "cpu") == [_key(1), _key(2)]
    pids = _spare_pids(1) + _spare_pids(2)
    dist.shutdown_pools()
    assert_no_leftovers(pids)


def test_standby_ranks_have_built_an_engine_and_a_tests_first_call_is_cheaper(spares,
                                                                             monkeypatch):
    """warm_up: the first engine in a spawned process costs ~4 s more than the next on this
    machine; a standby rank pays that before anyone waits. (A forked rank's torch imports
    come from the fork server: there the difference is a few tenths of a second.)"""
    from dsconform.checks.zero_vs_ddp import ZeroCase, train_zero_and_ddp

    monkeypatch.setenv("DSCONFORM_FORKSERVER", "0")
    case = ZeroCase(stage=2, dtype="fp32", optimizer="sgd", grad_accum=1, world_size=2)
    timings = {}
    for label, warm in (("cold", False), ("warm", True)):
        dist.shutdown_pools()
        monkeypatch.setattr(groups, "RANK_WARMUP", warm)
        dist.start_spares([2], "cpu")
        dist.settle_spares()  # start-up (and warm-up) done: only the call is timed
        t0 = time.monotonic()
        dist.run_ranks(train_zero_and_ddp, 2, args=(case,), timeout_s=300, accelerator="cpu")
        timings[label] = time.monotonic() - t0
    print(timings)
    assert timings["warm"] < timings["cold"] - 1.0, timings


def test_fresh_process_calls_never_get_warmed_up_ranks(spares):
    """A resume "in a fresh process" must run where no engine was ever built: the warmed-up
    standby ranks serve pooled calls only."""
    dist.start_spares([2], "cpu")
    warm = _spare_pids()
    assert dist.run_ranks(rank_fns.warmed_up, 2, timeout_s=TIMEOUT_S, reuse=False,
                          accelerator="cpu") == [False, False]
    assert dist.run_ranks(rank_fns.warmed_up, 2, timeout_s=TIMEOUT_S, reuse=False,
                          accelerator="cpu") == [False, False]  # from the fresh standby
    assert _spare_pids() == warm, "a fresh-process call took the warmed-up standby ranks"
    assert dist.run_ranks(rank_fns.warmed_up, 2, timeout_s=TIMEOUT_S,
                          accelerator="cpu") == [True, True]


def test_fresh_standby_ranks_import_ahead_but_build_no_engine(spares, monkeypatch):
    """Standby ranks for fresh-process calls import what a first engine would (rank.prime) and
    build none; with DSCONFORM_RANK_WARMUP=0 they import nothing ahead. Spawned ranks: a
    forked one has the fork server's imports whatever the setting."""
    monkeypatch.setenv("DSCONFORM_FORKSERVER", "0")
    assert dist.run_ranks(rank_fns.fresh_state, 2, timeout_s=TIMEOUT_S, reuse=False,
                          accelerator="cpu") == [(False, False), (False, False)]  # spawned
    dist.settle_spares()
    assert dist.run_ranks(rank_fns.fresh_state, 2, timeout_s=TIMEOUT_S, reuse=False,
                          accelerator="cpu") == [(False, True), (False, True)]  # the standby
    dist.shutdown_pools()
    monkeypatch.setattr(groups, "RANK_WARMUP", False)
    dist.run_ranks(rank_fns.fresh_state, 2, timeout_s=TIMEOUT_S, reuse=False, accelerator="cpu")
    dist.settle_spares()
    assert dist.run_ranks(rank_fns.fresh_state, 2, timeout_s=TIMEOUT_S, reuse=False,
                          accelerator="cpu") == [(False, False), (False, False)]


@pytest.mark.parametrize("markexpr, selects", [
    ("gpu", True), ("gpu and not slow", True), ("anynode or gpu", True), ("not gpu", False),
    ("not gpu and not slow", False), ("", False), ("multigpu", False), ("gpu_x", False)])
def test_ranks_start_before_collection_only_under_a_gpu_selection(markexpr, selects):
    """The fork server starts at configure (before collection) only when -m selects GPU tests:
    `-m "not gpu"` on a GPU node starts none early."""
    from dsconform.profile.select import selects_gpu_tests as _selects_gpu_tests

    assert _selects_gpu_tests(markexpr) is selects
