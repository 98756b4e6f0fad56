"""Cell batches (dsconform.plugin.batch) through the real plugin: every cell keeps its own outcome.

A small suite of batched cells (a pass, a rank that raises, a unanimous skip, a plan that
refuses, a cell the gate skips, two that sleep) runs in an in-process pytest session, with two
lanes forced and with batches off; the outcomes must be the same, the gated cell must never be
planned, and with lanes the sleeping cells must overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsconform.harness import api as dist
from dsconform.harness import lanes as harness_lanes
from tests import rank_fns  # noqa: F401 - imported once, before pytester snapshots sys.modules

SUITE = '''
import os
import time
from pathlib import Path

import pytest
from dsconform.suite import RankCall, batched, cell_results, requires
from tests import rank_fns

CAPABILITY = "demo"
CALLS = {"ok": (rank_fns.rank_and_sum, ()), "raise": (rank_fns.raise_on, (1,)),
         "skip": (rank_fns.skip_all, ("not on this node",)),
         "sleep1": (rank_fns.sleep_window, (5.0,)), "sleep2": (rank_fns.sleep_window, (5.0,)),
         "gated": (rank_fns.noop, ())}


def _stamp(what):
    with open(os.environ["DEMO_PLANNED"] + ".order", "a") as log:
        log.write("%s %f\\n" % (what, time.time()))


def test_measures(metrics):
    _stamp("measures")
    metrics.record("demo.value", 1.0, unit="x", better="higher")


def plan(params, workdir, run):
    kind = params["kind"]
    assert Path(workdir).is_dir()
    with open(os.environ["DEMO_PLANNED"], "a") as log:
        log.write(kind + "\\n")
    if kind == "refused":
        raise OSError("no room under --scratch for the demo")
    fn, args = CALLS[kind]
    return RankCall(fn, 2, 60, args=args, accelerator="cpu")


@batched(plan)
@pytest.mark.parametrize("kind", ["sleep1", "sleep2", "ok", "raise", "skip", "refused",
                                  pytest.param("gated", marks=requires(min_gpus=64))])
def test_cell(kind, request, scratch):
    _stamp("cell")
    results = cell_results(request, scratch)
    if kind == "ok":
        assert [r["sum"] for r in results] == [3.0, 3.0]
    if kind.startswith("sleep"):
        with open(os.environ["DEMO_PLANNED"] + ".windows", "a") as log:
            log.write("%f %f\\n" % tuple(results[0]))


def test_not_batched():
    _stamp("not_batched")
'''

#: A module whose tests share a module-scoped fixture: they stay together, in the latest phase
#: among them (measuring), so its measuring test comes before its batched cell and must wait for
#: the batch to end, that cell's 12 s included (one rank: it runs beside the two-rank cells and
#: ends last).
SHARED = '''
import os
import time

import pytest
from dsconform.suite import RankCall, batched, cell_results
from tests import rank_fns


@pytest.fixture(scope="module")
def shared():
    return 1


def test_shared_measures(shared, metrics):
    with open(os.environ["DEMO_PLANNED"] + ".order", "a") as log:
        log.write("shared_measures %f\\n" % time.time())


def plan(params, workdir, run):
    return RankCall(rank_fns.sleep_window, 1, 60, args=(12.0,), accelerator="cpu")


@batched(plan)
@pytest.mark.parametrize("n", [1])
def test_shared_cell(n, shared, request):
    window = cell_results(request)[0]
    with open(os.environ["DEMO_PLANNED"] + ".order", "a") as log:
        log.write("shared_cell %f\\n" % window[1])
'''


@pytest.fixture
def run_demo(pytester, tmp_path, monkeypatch, outside_xdist):
    pytester.makepyfile(test_demo=SUITE, test_demo_shared=SHARED)
    log = tmp_path / "planned.txt"
    monkeypatch.setenv("DEMO_PLANNED", str(log))

    def _run(lanes: str):
        dist.shutdown_pools()
        log.write_text("")
        windows = Path(str(log) + ".windows")
        windows.write_text("")
        order = Path(str(log) + ".order")
        order.write_text("")
        monkeypatch.setattr(harness_lanes, "LANES", lanes)
        results = pytester.path / f"results-{lanes}"
        result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(results),
                                    "-p", "no:cacheprovider", "-rA")
        dist.shutdown_pools()
        junit = (results / "junit.xml").read_text()
        sleeps = [tuple(map(float, line.split())) for line in windows.read_text().splitlines()]
        stamps = [(w, float(t)) for w, t in (line.split() for line in
                                             order.read_text().splitlines())]
        return result, log.read_text().split(), junit, sleeps, stamps
    return _run


def _outcomes(junit: str) -> dict:
    """Each test_cell case's outcome, from the run's junit.xml."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.fromstring(junit).iter("testcase"):
        name = case.get("name", "")
        if name.startswith("test_cell["):
            tags = {child.tag for child in case}
            word = ("FAILED" if tags & {"failure", "error"} else
                    "SKIPPED" if "skipped" in tags else "PASSED")
            out[name[len("test_cell["):-1]] = word
    return out


def _overlap(sleeps: list) -> bool:
    (a0, a1), (b0, b1) = sleeps
    return max(a0, b0) < min(a1, b1)


def test_batched_cells_keep_their_own_outcomes_and_overlap(run_demo, pytester):
    """The same outcomes with and without lanes; with two lanes the two 5-s cells (the first
    two: both lanes start with one) run at the same time, with one lane one after the other.
    With lanes the batch runs in the background: the test that is neither batched nor measuring
    runs first, before the batch's cells have ended, and the measuring test runs last, after
    every cell has ended; without lanes the file's order stands."""
    serial, serial_planned, serial_junit, serial_sleeps, serial_order = run_demo("1")
    batched, batch_planned, batch_junit, batch_sleeps, batch_order = run_demo("2")
    expected = {"ok": "PASSED", "raise": "FAILED", "skip": "SKIPPED", "refused": "FAILED",
                "sleep1": "PASSED", "sleep2": "PASSED", "gated": "SKIPPED"}
    assert _outcomes(serial_junit) == expected, serial.outlines
    assert _outcomes(batch_junit) == expected, batched.outlines
    text = "\n".join(batched.outlines)
    assert "rank 1 of 2 raised" in text and "no room under --scratch for the demo" in text
    assert "not on this node" in text
    # The gate's skip is decided before planning: the gated cell never reaches the batch.
    assert "gated" not in batch_planned and "gated" not in serial_planned
    assert sorted(batch_planned) == sorted(serial_planned)
    assert "cell batch: 6 cells started in the background (2 lanes per world size)" in text
    assert "cell batch: 6 cells of test_cell, test_shared_cell at once (2 lanes per world " \
        "size)" in text
    assert "cell batch" not in "\n".join(serial.outlines)
    # summary.txt in --results holds what the console's summary says of the batch and ranks.
    kept = (pytester.path / "results-2" / "summary.txt").read_text()
    assert "cell batch: 6 cells of test_cell, test_shared_cell at once" in kept, kept
    assert "rank start-up, median of " in kept, kept
    assert _overlap(batch_sleeps), batch_sleeps
    assert not _overlap(serial_sleeps), serial_sleeps
    # The order the tests ran in: the file's without lanes; the batch's phases with.
    assert [w for w, _ in serial_order] == (["measures"] + ["cell"] * 6 + ["not_batched"]
                                            + ["shared_measures", "shared_cell"])
    assert [w for w, _ in batch_order] == (["not_batched"] + ["cell"] * 6 + ["measures"]
                                           + ["shared_measures", "shared_cell"])
    stamp = dict(batch_order)
    last_sleep_end = max(end for _, end in batch_sleeps)
    assert stamp["not_batched"] < last_sleep_end, "the unbatched test waited for the batch"
    # shared_cell's stamp is the end of its call's sleep, the batch's last call.
    assert stamp["shared_measures"] >= stamp["shared_cell"], \
        "a measuring test ran beside the batch"
    assert "dsconform_batch_wait_seconds" in batch_junit


#: Cells of two steps, the second on new processes (the resume-in-a-fresh-process shape), and no
#: measuring test: the session ends as soon as the last cell's test has its outcome.
STEPS = '''
import pytest
from dsconform.suite import RankCall, batched, cell_results
from tests import rank_fns


def plan(params, workdir, run):
    return [RankCall(rank_fns.pid_and_calls, 2, 60, accelerator="cpu"),
            RankCall(rank_fns.pid_and_calls, 2, 60, accelerator="cpu", fresh=True)]


@batched(plan)
@pytest.mark.parametrize("n", [1, 2])
def test_steps(n, request, scratch):
    first, second = cell_results(request, scratch)
    assert not {p for p, _ in first} & {p for p, _ in second}, (first, second)
    assert [c for _, c in second] == [1, 1], second
'''


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_cells_of_steps_and_a_batch_that_ended_on_its_own(pytester, monkeypatch, lanes,
                                                          outside_xdist):
    """A plan may return steps: the cell gets each step's results, the fresh step's from new
    processes, with batches and without. A batch whose cells all ended is not reported as
    stopped early, even when the session ends right after its last cell's test."""
    pytester.makepyfile(test_steps_demo=STEPS)
    dist.shutdown_pools()
    monkeypatch.setattr(harness_lanes, "LANES", lanes)
    result = pytester.runpytest("-p", "fixtures.plugin", "--results",
                                str(pytester.path / "results"), "-p", "no:cacheprovider")
    dist.shutdown_pools()
    result.assert_outcomes(passed=2)
    text = "\n".join(result.outlines)
    if lanes == "2":
        assert "cell batch: 2 cells of test_steps at once" in text, text
    assert "stopped early" not in text, text


def test_where_batches_only_the_cells_it_names():
    """@batched(where=...): a cell whose parametrize values it rejects is no batch cell (its
    body makes its own calls, cost 0), the others are (without a record, the neutral cost)."""
    from types import SimpleNamespace

    from dsconform.plugin import batch

    def plan(params, workdir, run):
        raise AssertionError("not planned here")

    @batch.batched(plan, where=lambda params: params["world_size"] == 1)
    def test_fn(world_size):
        pass

    def item(world_size):
        return SimpleNamespace(function=test_fn,
                               callspec=SimpleNamespace(params={"world_size": world_size}))

    assert batch.has_plan(item(1))
    assert not batch.has_plan(item(2))
    assert batch.has_plan(SimpleNamespace(function=batch.batched(plan)(lambda: None),
                                          callspec=SimpleNamespace(params={})))


def test_known_issue_measurements_run_after_the_others():
    """A measurement a known issue covers fails on purpose and stops its ranks; it runs after
    the other measurements, which would otherwise wait for new ranks. Elsewhere the order
    stands."""
    from types import SimpleNamespace

    from dsconform.plugin.items import order_key as _order_key
    from dsconform.plugin.keys import COVERED_BY

    def item(name: str, known: bool):
        stash = {COVERED_BY: ["DS-1"]} if known else {}
        return SimpleNamespace(fspath=f"/x/suites/test_{name}.py", stash=stash, name=name,
                               get_closest_marker=lambda _: None)

    known, plain = item("known", True), item("plain", False)
    assert sorted([known, plain], key=lambda it: _order_key(it, 3)) == [plain, known]
    for phase in (0, 1, 2):
        assert sorted([known, plain], key=lambda it: _order_key(it, phase)) == [known, plain]
    # A measurement a known issue covers still runs before a `run_last` test.
    last = SimpleNamespace(fspath="/x/suites/test_last.py", stash={}, name="last",
                           get_closest_marker=lambda m: m == "run_last" or None)
    assert sorted([last, known], key=lambda it: _order_key(it, 3)) == [known, last]


def test_tests_beside_the_batch_that_load_an_op_run_after_those_that_load_none(pytester):
    """A test beside the batch that loads an op waits for its build at setup: the tests that
    load none run first, while the builds go on."""
    from dsconform.plugin.items import order_key

    items = pytester.getitems("""
import pytest

@pytest.mark.requires(op="async_io")
def test_loads_an_op():
    pass

def test_loads_none():
    pass
""")
    from dsconform.plugin import batch

    phase = batch.phases(items)
    assert [phase[id(it)] for it in items] == [1, 0]
    ordered = sorted(items, key=lambda it: order_key(it, phase[id(it)]))
    assert [it.name for it in ordered] == ["test_loads_none", "test_loads_an_op"]
