"""A cell batch's order comes from the last run's records: each cell's seconds in records.jsonl
(its batched call's seconds where it has them), a neutral default where there is none."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

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
    (tmp_path / "records.previous.jsonl").write_text(
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


SEES_LAST_SECONDS = """
import json, time
from pathlib import Path

def test_slow():
    time.sleep(0.3)

def test_sees(request):
    from dsconform.plugin.runstate import STATE
    seen = request.config.stash[STATE].last_seconds
    Path(request.config.getoption("--results"), "seen.json").write_text(json.dumps(seen))
"""


@pytest.mark.parametrize("twice", ["same folder", "a refused run between"])
def test_a_run_reads_the_seconds_of_the_last_run_in_its_results_folder(pytester, tmp_path,
                                                                       twice):
    """The last run's journal is set aside as the run begins (fail closed): its seconds are
    still what the next run's batch orders by, and a refused run between them loses nothing."""
    pytester.makepyfile(test_two=SEES_LAST_SECONDS)
    res = tmp_path / "res"
    args = ("-p", "fixtures.plugin", "-p", "no:cacheprovider", "--results", str(res))
    pytester.runpytest(*args).assert_outcomes(passed=2)
    assert json.loads((res / "seen.json").read_text()) == {}
    if twice == "a refused run between":
        assert pytester.runpytest(*args, "--profile", str(tmp_path / "none.toml")).ret == 4
    pytester.runpytest(*args).assert_outcomes(passed=2)
    seen = json.loads((res / "seen.json").read_text())
    assert set(seen) == {"test_two.py::test_slow", "test_two.py::test_sees"}
    assert seen["test_two.py::test_slow"] >= 0.3
