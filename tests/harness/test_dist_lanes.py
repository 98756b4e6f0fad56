"""Lanes (dsconform.harness.lanes.run_concurrently): independent calls at once over several groups.

Run on the CPU accelerator with two lanes forced ("auto" gives one lane on this 2-core machine).
"""

from __future__ import annotations

import os
import time

import pytest

from dsconform.harness import api as dist
from dsconform.harness import lanes as harness_lanes
from dsconform.harness import pool
from dsconform.harness.groups import GROUPS
from dsconform.harness.lanes import RankCall

try:
    from tests import rank_fns
except ImportError:
    import rank_fns

from tests.harness.test_dist import assert_no_leftovers

TIMEOUT_S = 60.0


@pytest.fixture
def clean():
    dist.shutdown_pools()
    yield
    dist.shutdown_pools()
    assert_no_leftovers()


def _call(fn, ws: int = 2, *args, timeout_s: float = TIMEOUT_S) -> RankCall:
    return RankCall(fn, ws, timeout_s, args=args, accelerator="cpu")


def test_auto_lanes_only_on_big_cuda_machines(monkeypatch):
    monkeypatch.setattr(harness_lanes, "LANES", "auto")
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setattr(harness_lanes, "worker_gpus", lambda: ["0", "1"])
    assert harness_lanes.lanes_for("cuda") == harness_lanes.LANES_AUTO
    monkeypatch.setattr(harness_lanes, "worker_gpus", lambda: ["0"])
    assert harness_lanes.lanes_for("cuda") == harness_lanes.LANES_ONE_GPU  # one-rank lanes only
    monkeypatch.setattr(harness_lanes, "check_accelerator", lambda a=None: a or "cuda")
    assert harness_lanes._lane_threads() == 32 // harness_lanes.LANES_ONE_GPU
    monkeypatch.setattr(harness_lanes, "check_accelerator", lambda a=None: a or "cpu")
    assert harness_lanes.lanes_for("cpu") == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert harness_lanes.lanes_for("cuda") == 1
    monkeypatch.setattr(harness_lanes, "LANES", "3")
    assert harness_lanes.lanes_for("cpu") == 3
    monkeypatch.setattr(harness_lanes, "LANES", "many")
    with pytest.raises(ValueError, match="DSCONFORM_LANES"):
        harness_lanes.lanes_for("cpu")


def test_calls_run_at_once_on_separate_pools(clean):
    """Two 2-rank calls that each sleep 3 s finish in well under 6 s, on different processes,
    and each returns its own ranks' values."""
    harness_lanes.start_lanes([2], "cpu", lanes=2)  # as a GPU run does at collection
    dist.settle_spares()
    t0 = time.monotonic()
    out = harness_lanes.run_concurrently([_call(rank_fns.sleep_then_pid, 2, 3.0),
                                 _call(rank_fns.sleep_then_pid, 2, 3.0)], lanes=2)
    took = time.monotonic() - t0
    assert [o[0] for o in out] == ["ok", "ok"], out
    pids = [set(o[1]) for o in out]
    assert len(pids[0]) == 2 and not pids[0] & pids[1], pids
    assert took < 5.5, f"two 3-s calls on two lanes took {took:.1f} s: they ran one after another"
    stats = dist.startup_stats()
    assert stats["lanes"] >= 2 and stats["lane_calls"] >= 2


def test_a_failing_call_fails_alone_and_its_lane_recovers(clean):
    """The failure is that call's outcome (the RankError run_ranks raises); the other calls,
    before and after it on the same lane, still run; a skip stays a skip."""
    calls = [_call(rank_fns.raise_on, 2, 1), _call(rank_fns.rank_and_sum),
             _call(rank_fns.skip_all, 2, "not here"), _call(rank_fns.rank_and_sum),
             _call(rank_fns.rank_and_sum, 1)]
    done = []
    out = harness_lanes.run_concurrently(calls, lanes=2, on_done=lambda i, o, s: done.append(i))
    assert sorted(done) == list(range(len(calls)))
    kind, exc = out[0]
    assert kind == "raise" and isinstance(exc, dist.RankError) and "rank 1 of 2" in str(exc)
    assert out[1][0] == out[3][0] == "ok" and out[1][1][0]["sum"] == 3.0
    assert out[2][0] == "raise" and isinstance(out[2][1], pytest.skip.Exception)
    assert "not here" in str(out[2][1])
    assert out[4][0] == "ok" and out[4][1][0]["world"] == 1


def test_a_hanging_call_times_out_alone(clean):
    calls = [_call(rank_fns.hang_on, 2, 0, timeout_s=3.0), _call(rank_fns.rank_and_sum)]
    out = harness_lanes.run_concurrently(calls, lanes=2)
    assert out[0][0] == "raise" and isinstance(out[0][1], dist.RankTimeout)
    assert out[1][0] == "ok"


def test_bad_calls_are_their_own_outcome(clean):
    calls = [RankCall(lambda: 1, 2, TIMEOUT_S, accelerator="cpu"), _call(rank_fns.noop),
             RankCall(rank_fns.noop, 0, TIMEOUT_S, accelerator="cpu")]
    out = harness_lanes.run_concurrently(calls, lanes=2)
    assert out[0][0] == "raise" and isinstance(out[0][1], TypeError)
    assert out[1] == ("ok", [None, None])
    assert out[2][0] == "raise" and isinstance(out[2][1], ValueError)


def test_one_lane_runs_calls_in_turn_through_run_ranks(clean):
    out = harness_lanes.run_concurrently([_call(rank_fns.pid, 1), _call(rank_fns.pid, 1),
                                 _call(rank_fns.raise_on, 1, 0)], lanes=1)
    assert out[0] == out[1] and out[0][0] == "ok"  # the same pooled rank, one after the other
    assert out[2][0] == "raise" and isinstance(out[2][1], dist.RankError)


def test_one_rank_lanes_take_the_gpus_in_turn(monkeypatch):
    monkeypatch.setattr(pool, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(pool, "xdist_worker", lambda: (0, 1))
    monkeypatch.setattr(harness_lanes, "worker_gpus", lambda: ["0", "1"])
    keys = harness_lanes._lane_keys(1, "cuda", 4)
    assert [k[2] for k in keys] == [("0",), ("1",), ("0",), ("1",)]
    assert harness_lanes._lane_keys(2, "cuda", 2) == [(2, "cuda", ("0", "1"))] * 2
    with pytest.raises(dist.InsufficientGPUs):
        harness_lanes._lane_keys(3, "cuda", 2)



def test_idle_lane_ranks_outlive_the_batch_thread(clean):
    """Ranks die with the thread that started them (PR_SET_PDEATHSIG): a lane that replaces
    its failed ranks inside its own thread would leave dead ranks behind when it ends. The
    owner's starter thread starts them instead, so idle lanes are alive for the next batch."""
    harness_lanes.start_lanes([1], "cpu", lanes=2)
    dist.settle_spares()
    # The failing lane starts new ranks for the third call while the other lane sleeps.
    calls = [_call(rank_fns.raise_on, 1, 0), _call(rank_fns.sleep_then_pid, 1, 5.0),
             _call(rank_fns.pid, 1)]
    out = harness_lanes.run_concurrently(calls, lanes=2)
    assert [o[0] for o in out] == ["raise", "ok", "ok"]
    time.sleep(1.0)
    idle = GROUPS.idle((1, "cpu", (), "lane"))
    assert len(idle) == 2 and all(p.alive() for p in idle), [
        [pr.exitcode for pr in p.procs] for p in idle]


def test_a_batch_stopped_from_another_thread_kills_its_lanes(clean):
    """cancel (a session that ends early) kills the lanes mid-call: the batch returns at once,
    the calls it stopped have no outcome and no on_done."""
    import threading

    cancel = threading.Event()
    done = []
    calls = [_call(rank_fns.hang_forever_in_sleep, 1), _call(rank_fns.hang_forever_in_sleep, 1)]
    threading.Timer(8.0, cancel.set).start()
    t0 = time.monotonic()
    out = harness_lanes.run_concurrently(calls, lanes=2, on_done=lambda i, o, s: done.append(i),
                                cancel=cancel)
    assert time.monotonic() - t0 < 30.0
    assert out == [None, None] and done == []


def test_a_batch_sees_the_environment_it_started_with(clean, monkeypatch):
    """A background batch's calls must not pick up what a test running meanwhile sets: the
    variable changes while the lanes' ranks are still starting."""
    import threading

    monkeypatch.setenv("DSCONFORM_DEMO_VAR", "at-start")
    calls = [_call(rank_fns.noop, 1),
             RankCall(rank_fns.read_env_var, 1, TIMEOUT_S, args=("DSCONFORM_DEMO_VAR",),
                      accelerator="cpu")]
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(harness_lanes.run_concurrently(calls, lanes=2)))
    worker.start()
    time.sleep(0.5)
    monkeypatch.setenv("DSCONFORM_DEMO_VAR", "changed-meanwhile")
    worker.join(120)
    assert out[1] == ("ok", ["at-start"]), out


def test_run_ranks_runs_while_a_batch_does(clean):
    """A background batch starts while a test in the main thread is inside run_ranks: the
    batch takes its lanes and runs at once (run_ranks's call lock is not the pool tables'
    lock), so the calls overlap."""
    import threading

    harness_lanes.start_lanes([1], "cpu", lanes=2)
    dist.settle_spares()
    dist.run_ranks(rank_fns.noop, 1, timeout_s=TIMEOUT_S, accelerator="cpu")  # pooled now
    calls = [_call(rank_fns.sleep_window, 1, 2.0), _call(rank_fns.sleep_window, 1, 2.0)]
    out: list = []
    worker = threading.Timer(
        1.0, lambda: out.extend(harness_lanes.run_concurrently(calls, lanes=2)))
    worker.start()
    mine = dist.run_ranks(rank_fns.sleep_window, 1, timeout_s=TIMEOUT_S, args=(5.0,),
                          accelerator="cpu")[0]
    worker.join(120)
    assert [o[0] for o in out] == ["ok", "ok"], out
    windows = [o[1][0] for o in out]
    assert all(max(a, mine[0]) < min(b, mine[1]) for a, b in windows), (mine, windows)


def _steps(ws: int, fresh: bool) -> list[RankCall]:
    return [_call(rank_fns.pid_and_calls, ws), _call(rank_fns.pid_and_calls, ws),
            RankCall(rank_fns.pid_calls_warmed, ws, TIMEOUT_S, accelerator="cpu", fresh=fresh)]


@pytest.mark.parametrize("lanes", [1, 2])
def test_steps_run_in_turn_and_a_fresh_step_gets_new_processes(clean, lanes):
    """A list of steps is one entry: its outcome lists each step's results. Steps share the
    lane's ranks (the second answers its second call) until a fresh step, which runs on new
    processes that ran no call and built no warm-up engine: neither its lane's nor an idle
    pool.
    With one lane the steps go through run_ranks (reuse=False for the fresh one)."""
    harness_lanes.start_lanes([2], "cpu", lanes=2)
    dist.settle_spares()
    # A batch of plain calls first: idle lane pools that ran a call, which a fresh step must
    # not take.
    harness_lanes.run_concurrently([_call(rank_fns.pid_and_calls)] * 2, lanes=lanes)
    out = harness_lanes.run_concurrently([_call(rank_fns.pid_and_calls), _steps(2, True),
                                 _steps(2, False)], lanes=lanes)
    assert [o[0] for o in out] == ["ok"] * 3, out
    first, second, third = out[1][1]
    assert [c for _, c in second] == [c + 1 for _, c in first]  # the same ranks, in turn
    assert {p for p, _ in first} == {p for p, _ in second}
    assert [c for _, c, _ in third] == [1, 1], f"the fresh step ran on used ranks: {third}"
    assert not any(w for _, _, w in third), f"the fresh step ran on warmed-up ranks: {third}"
    assert not {p for p, _, _ in third} & {p for p, _ in first}
    reused = out[2][1][2]  # no fresh flag: the lane's ranks again
    assert [c for _, c, _ in reused] == [c + 2 for _, c in out[2][1][0]]
    # A fresh call on its own (no step before it to start its ranks ahead), with used and
    # warmed-up idle pools about.
    harness_lanes.start_lanes([2], "cpu", lanes=2)
    dist.settle_spares()
    alone = harness_lanes.run_concurrently([_steps(2, True)[2]] * 2, lanes=lanes)
    assert [[(c, w) for _, c, w in o[1]] for o in alone] == [[(1, False)] * 2] * 2, alone


def test_a_failing_step_is_the_entry_outcome(clean):
    """The first step's RankError is the entry's outcome; the ranks started ahead for its fresh
    step are killed (the clean fixture finds no leftovers)."""
    calls = [[_call(rank_fns.raise_on, 2, 0),
              RankCall(rank_fns.pid_and_calls, 2, TIMEOUT_S, accelerator="cpu", fresh=True)],
             _call(rank_fns.rank_and_sum),
             [_call(rank_fns.noop, 2), _call(rank_fns.noop, 1)]]
    out = harness_lanes.run_concurrently(calls, lanes=2)
    assert out[0][0] == "raise" and isinstance(out[0][1], dist.RankError), out[0]
    assert out[1][0] == "ok"
    assert out[2][0] == "raise" and "only a fresh step" in str(out[2][1])


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_fresh_step_may_change_the_world_size(clean, lanes):
    """A save on 2 ranks then a load on 1 (and the other way round), as a universal
    checkpoint's reshard: the fresh step gets new ranks of its own size; that pool is not kept
    as one of the lane's (no idle lane pool of the wrong size)."""
    def fresh(ws):
        return RankCall(rank_fns.pid_calls_warmed, ws, TIMEOUT_S, accelerator="cpu", fresh=True)

    out = harness_lanes.run_concurrently([[_call(rank_fns.pid_and_calls, 2), fresh(1)],
                                 [_call(rank_fns.pid_and_calls, 1), fresh(2)],
                                 _call(rank_fns.pid_and_calls, 2)], lanes=lanes)
    assert [o[0] for o in out] == ["ok"] * 3, out
    for (first, second), (ws_first, ws_second) in zip((out[0][1], out[1][1]), ((2, 1), (1, 2))):
        assert (len(first), len(second)) == (ws_first, ws_second)
        assert [(c, w) for _, c, w in second] == [(1, False)] * ws_second, second
        assert not {p for p, _, _ in second} & {p for p, _ in first}
    kept = [key for key, _ in GROUPS.table.values()]  # one lane of 1 rank, two of 2 ranks
    assert kept.count((1, "cpu", (), "lane")) <= 1 and kept.count((2, "cpu", (), "lane")) <= 2, \
        f"a fresh step's group of another world size was kept as a lane's: {kept}"


def test_lanes_take_the_first_ready_call_and_wait_while_none_is(clean):
    """An entry that is not ready (its op still building) waits while later ones run: two lanes
    take entries 1 and 2, and entry 0 only once entry 2 has ended."""
    taken: list[int] = []
    ended: set[int] = set()
    out = harness_lanes.run_concurrently(
        [_call(rank_fns.sleep_then_pid, 1, 0.1) for _ in range(3)], lanes=2,
        before=taken.append, ready=lambda i: i != 0 or 2 in ended,
        on_done=lambda i, outcome, seconds: ended.add(i))
    assert [o[0] for o in out] == ["ok", "ok", "ok"], out
    assert sorted(taken[:2]) == [1, 2] and taken[2] == 0, taken
