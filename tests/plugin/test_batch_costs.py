"""A cell batch's order comes from the last run's records: each cell's seconds in records.jsonl
(its batched call's seconds where it has them), a neutral default where there is none."""

from __future__ import annotations

import json
from types import SimpleNamespace

from dsconform.plugin import batch
from dsconform.plugin.runstate import STATE
from dsconform.results import durations


def _entry(nodeid: str, outcome: str, duration: float, batch_seconds: float | None = None):
    entry = {"outcome": {"nodeid": nodeid, "outcome": outcome, "capability": "x",
                         "duration_s": duration}, "start": 0.0, "stop": duration}
    if batch_seconds is not None:
        entry["batch_seconds"] = batch_seconds
    return entry


def test_the_journal_gives_each_test_its_seconds(tmp_path):
    """A batched cell's call seconds win over its test's duration (which only waited); a skipped
    test and a torn last line (a killed run) give nothing."""
    lines = [_entry("s::a", "passed", 0.2, batch_seconds=7.5), _entry("s::b", "failed", 3.0),
             _entry("s::c", "skipped", 0.0), {"metric": {"name": "m"}}]
    (tmp_path / durations.JOURNAL).write_text(
        "\n".join(json.dumps(e) for e in lines) + '\n{"outcome": {"nodeid": "s::d"')
    assert durations.last_run_seconds(tmp_path) == {"s::a": 7.5, "s::b": 3.0}
    assert durations.last_run_seconds(tmp_path / "none") == {}
    assert durations.last_run_seconds(None) == {}


def test_the_batch_order_follows_the_recorded_seconds():
    """The cell that took longest last run starts first (batch.start sorts by cost); a cell
    without a record costs the neutral default."""
    def plan(params, workdir, run):
        raise AssertionError("not planned here")

    @batch.batched(plan)
    def test_fn(n):
        pass

    state = SimpleNamespace(last_seconds={"t[short]": 1.0, "t[long]": 9.0})
    config = SimpleNamespace(stash={STATE: state})

    def item(name):
        return SimpleNamespace(function=test_fn, name=name, nodeid=f"t[{name}]", config=config,
                               fspath="/x/suites/test_x.py", stash={},
                               get_closest_marker=lambda _: None,
                               callspec=SimpleNamespace(params={"n": name}))

    short, long, new = item("short"), item("long"), item("new")
    assert [batch.cost(it) for it in (short, long, new)] == [1.0, 9.0, 1.0]
    rs = SimpleNamespace(op_builds=None)
    assert [it.name for it in batch.start_order([short, new, long], rs)] == \
        ["long", "short", "new"]
    state.last_seconds = {"t[short]": 12.0, "t[long]": 9.0}  # the last run says otherwise
    assert [it.name for it in batch.start_order([short, new, long], rs)] == \
        ["short", "long", "new"]
