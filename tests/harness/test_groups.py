"""The one owner of rank groups (dsconform.harness.groups.RankGroups): one table, leases, groups
kept warm per key, quiet during measurements. Its table logic runs here on stand-in groups (no
process); tests/harness/test_dist*.py run it with real ranks."""

from __future__ import annotations

import pytest

from dsconform.harness import groups
from dsconform.harness.groups import RankGroups


class FakeGroup:
    """What the owner and close_pools touch of a Pool; ready as soon as started_now is asked."""

    started: list[FakeGroup] = []

    def __init__(self, world_size, accelerator, gpus, pg_timeout_s, **kw) -> None:
        self.world_size, self.pg_timeout_s, self.kw = world_size, pg_timeout_s, kw
        self.closed, self.ready, self.answered = False, False, False
        self.procs, self.phases = [], []
        self.owner_pid = groups.os.getpid()
        FakeGroup.started.append(self)

    def start_up(self):
        self.ready = True
        self.phases = [{"python": 0.1}]
        return self

    def started_now(self) -> bool:
        if self.answered:
            self.start_up()
        return self.ready

    def alive(self) -> bool:
        return not self.closed

    def kill(self) -> None:
        self.closed = True

    signal_kill = kill

    def request_exit(self) -> None:
        pass

    def reap(self) -> None:
        pass


@pytest.fixture
def owner(monkeypatch):
    monkeypatch.setattr(groups, "Pool", FakeGroup)
    monkeypatch.setattr(groups, "clear_build_locks", lambda: None)
    monkeypatch.setattr(groups, "MAX_POOLS", 2)
    FakeGroup.started = []
    rg = RankGroups()
    yield rg
    rg.shutdown()


BASE = (2, "cpu", ())


def test_a_lease_takes_an_idle_group_of_the_kinds_asked_else_starts_one(owner):
    first = owner.lease(BASE, ("pooled", "standby"), "plain", 3600, "call")
    assert first.ready and first.kw["warm"] is False and owner.table[first][1] == "call"
    owner.release(first, True, "pooled")
    assert owner.lease(BASE, ("pooled", "standby"), "plain", 3600, "next") is first
    owner.release(first, True, "pooled")
    # A fresh-process call never takes a group that ran a call.
    fresh = owner.lease(BASE, ("fresh",), "plain", 120, "fresh")
    assert fresh is not first
    owner.release(fresh, True, None)
    assert fresh.closed and fresh not in owner.table
    # One that ran a call of a shorter process-group timeout cannot serve a longer call.
    assert owner.lease(BASE, ("pooled",), "plain", 7200, "long") is not first
    assert first.closed
    stats = owner.stats
    assert stats["pools"] == 3 and stats["from_standby"] == 0
    assert owner.startup_phases()[0] == 3


def test_an_unhealthy_call_kills_its_group_and_pooled_groups_are_capped(owner):
    bad = owner.lease(BASE, ("pooled",), "plain", 3600, "call")
    owner.release(bad, False, "pooled")
    assert bad.closed and not owner.table
    kept = []
    for ws in (1, 2, 3):
        g = owner.lease((ws, "cpu", ()), ("pooled",), "plain", 3600, "call")
        owner.release(g, True, "pooled")
        kept.append(g)
    assert kept[0].closed and not kept[1].closed and not kept[2].closed  # least recently used


def test_keep_starts_up_to_n_and_quiet_stops_what_is_starting_then_restarts_it(owner):
    lane = (*BASE, "lane")
    assert owner.keep(lane, 3, threads=4) == 3 and owner.keep(lane, 3) == 0
    ready = owner.idle(lane)[0]
    ready.answered = True  # every rank answered: started up, kept through the quiet
    standby = (*BASE, "standby")
    owner.keep(standby, 1)
    with owner.quiet():
        assert owner.idle(lane) == [ready]
        assert owner.idle(standby) == []
        assert owner.keep(standby, 1) == 0
    assert len(owner.idle(lane)) == 3 and len(owner.idle(standby)) == 1
    owner.drop(("lane", "lane-fresh"))
    assert owner.idle(lane) == [] and ready.closed
    with owner.quiet():
        pass
    assert owner.idle(lane) == [], "a dropped key was started again"


def test_standby_groups_start_only_in_the_first_environment(owner, monkeypatch):
    owner.keep((*BASE, "standby"), 1)
    monkeypatch.setenv("DSCONFORM_TEST_GROUPS_ENV", "x")
    assert owner.keep((1, "cpu", (), "standby"), 1) == 0
    assert owner.keep((1, "cpu", (), "lane"), 1) == 1  # lanes get the call's environment


def test_kill_leased_kills_only_that_holders_groups(owner):
    mine = owner.lease(BASE, ("lane",), "lane", 3600, "batch")
    other = owner.lease(BASE, ("lane",), "lane", 3600, "other")
    owner.kill_leased("batch")
    assert mine.closed and not other.closed
    owner.shutdown()
    assert other.closed and not owner.table
