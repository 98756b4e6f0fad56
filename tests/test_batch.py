"""Cell batches (dsconform.batch) through the real plugin: every cell keeps its own outcome.

A small suite of batched cells (a pass, a rank that raises, a unanimous skip, a plan that
refuses, a cell the gate skips, two that sleep) runs in an in-process pytest session, with two
lanes forced and with batches off; the outcomes must be the same, the gated cell must never be
planned, and with lanes the sleeping cells must overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsconform import dist
from tests import rank_fns  # noqa: F401 - imported once, before pytester snapshots sys.modules

SUITE = '''
import os
from pathlib import Path

import pytest
from dsconform.suite import RankCall, batched, cell_results, requires
from tests import rank_fns

CAPABILITY = "demo"
CALLS = {"ok": (rank_fns.rank_and_sum, ()), "raise": (rank_fns.raise_on, (1,)),
         "skip": (rank_fns.skip_all, ("not on this node",)),
         "sleep1": (rank_fns.sleep_window, (5.0,)), "sleep2": (rank_fns.sleep_window, (5.0,)),
         "gated": (rank_fns.noop, ())}


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
    results = cell_results(request, scratch)
    if kind == "ok":
        assert [r["sum"] for r in results] == [3.0, 3.0]
    if kind.startswith("sleep"):
        with open(os.environ["DEMO_PLANNED"] + ".windows", "a") as log:
            log.write("%f %f\\n" % tuple(results[0]))


def test_not_batched():
    pass
'''


@pytest.fixture
def run_demo(pytester, tmp_path, monkeypatch):
    pytester.makepyfile(test_demo=SUITE)
    log = tmp_path / "planned.txt"
    monkeypatch.setenv("DEMO_PLANNED", str(log))

    def _run(lanes: str):
        dist.shutdown_pools()
        log.write_text("")
        windows = Path(str(log) + ".windows")
        windows.write_text("")
        monkeypatch.setattr(dist, "LANES", lanes)
        results = pytester.path / f"results-{lanes}"
        result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(results),
                                    "-p", "no:cacheprovider", "-rA")
        dist.shutdown_pools()
        junit = (results / "junit.xml").read_text()
        sleeps = [tuple(map(float, line.split())) for line in windows.read_text().splitlines()]
        return result, log.read_text().split(), junit, sleeps
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


def test_batched_cells_keep_their_own_outcomes_and_overlap(run_demo):
    """The same outcomes with and without lanes; with two lanes the two 5-s cells (the first
    two: both lanes start with one) run at the same time, with one lane one after the other."""
    serial, serial_planned, serial_junit, serial_sleeps = run_demo("1")
    batched, batch_planned, batch_junit, batch_sleeps = run_demo("2")
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
    assert "cell batch: 5 cells of test_cell at once (2 lanes per world size)" in text
    assert "cell batch" not in "\n".join(serial.outlines)
    assert _overlap(batch_sleeps), batch_sleeps
    assert not _overlap(serial_sleeps), serial_sleeps
