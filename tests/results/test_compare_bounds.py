"""dsconform compare judges a bounded value (a ZeRO difference, a loss-scaling gain: a number
its test holds to a tolerance) by that tolerance, not by a share of its own value."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsconform.cli import main
from dsconform.results import compare, records
from dsconform.results import format as results_format
from tests.compare_docs import doc, write

ROOT = Path(__file__).resolve().parents[2]
H200_X1 = ROOT / "results" / "reference" / "h200-x1"


def bounded(value: float, bound: float | None, name: str = "zero.loss_max_rel_diff",
            **params) -> records.Metric:
    return records.Metric("suites/test_zero.py::test_zero_matches_ddp[cpu-z1]", name, [value],
                          "1", "lower", None, params, "zero", bound=bound)


def change(base: float, new: float, bound: float | None = 1.6e-2, **kw) -> compare.Change:
    result = compare.compare(doc([bounded(base, bound, **kw)]), doc([bounded(new, bound, **kw)]))
    [c] = [c for c in result.changes if c.area == compare.METRIC]
    return c


def test_growth_inside_the_bound_is_no_regression():
    """The 1xH200 reference's bf16 cell: 4.4e-4 -> 5.3e-4 (+21%) under rtol 1.6e-2."""
    c = change(4.374e-4, 5.299e-4)
    assert c.kind == compare.UNCHANGED and c.bound == 1.6e-2
    assert "+21.1%" in c.detail and "2.7% -> 3.3% of its bound 0.016" in c.detail


def test_the_same_growth_without_a_bound_is_a_regression():
    """What the bound changes: the same numbers, unbounded, are judged at +-10% of themselves."""
    assert change(4.374e-4, 5.299e-4, bound=None).kind == compare.REGRESSION


def test_crossing_the_bound_is_a_regression_however_small_the_change():
    c = change(1.59e-2, 1.61e-2)
    assert c.kind == compare.REGRESSION and "crossed its bound" in c.detail
    assert c.beyond == "beyond its bound 0.016"


def test_approaching_the_bound_is_a_regression():
    c = change(1.0e-2, 1.3e-2)  # 62.5% -> 81.3% of the bound: past BOUND_APPROACH
    assert c.kind == compare.REGRESSION and "approaches its bound (past 80% of it)" in c.detail
    # already past the margin in BASE, still within: unchanged (it did not just approach)
    assert change(1.3e-2, 1.4e-2).kind == compare.UNCHANGED


def test_back_within_the_bound_is_an_improvement_and_beyond_in_both_is_unchanged():
    assert change(5e-2, 1e-3).kind == compare.IMPROVEMENT
    c = change(5e-2, 6e-2)
    assert c.kind == compare.UNCHANGED and "beyond its bound in both runs" in c.detail


def test_a_bit_exact_bound_makes_any_drift_a_regression():
    c = change(0.0, 1e-7, bound=0.0)
    assert c.kind == compare.REGRESSION and "crossed its bound" in c.detail
    assert change(0.0, 0.0, bound=0.0).kind == compare.UNCHANGED


def test_a_gain_bound_is_read_from_the_record():
    c = change(1.0e-4, 3.0e-4, bound=2e-3, name="loss_scaling.step_gain_dev")
    assert c.kind == compare.UNCHANGED and c.bound == 2e-3  # +200%, 15% of its bound


def test_files_without_a_bound_take_the_loss_bound_from_rtol():
    """Files written before extra_info.bound: the loss's bound is its rtol parameter."""
    base = doc([bounded(4.374e-4, None, rtol=1.6e-2, atol=1e-5)])
    new = doc([bounded(5.299e-4, None, rtol=1.6e-2, atol=1e-5)])
    for d in (base, new):
        assert "bound" not in d["benchmarks"][0]["extra_info"]
    [c] = compare.compare(base, new).of(compare.UNCHANGED, compare.METRIC)
    assert c.bound == pytest.approx(1.6e-2)


def test_the_recorder_writes_the_bound_and_the_loader_checks_it(tmp_path):
    seen = []
    rec = records.MetricsRecorder("t.py::test_x", "zero", seen.append)
    rec.record("zero.update_gain_dev", 1e-4, unit="1", better="lower", bound=1e-3, rtol=1e-5)
    entry = records.benchmark_entry(seen[0])
    assert entry["extra_info"]["bound"] == 1e-3 and entry["extra_info"]["params"] == {"rtol": 1e-5}
    assert rec.violations() == []  # a bound is the test's to enforce, not the recorder's
    d = doc(seen)
    d["benchmarks"][0]["extra_info"]["bound"] = "tight"
    with pytest.raises(results_format.ResultsFormatError, match=r"extra_info\.bound"):
        results_format.load_benchmarks(write(tmp_path / "b.json", d))


@pytest.mark.skipif(not (H200_X1 / "ds-0.19.6").is_dir(), reason="reference results absent")
def test_the_h200_x1_upgrade_has_no_bounded_regression(capsys):
    """The committed 1xH200 comparison 0.19.6 -> 0.19.8: its two ZeRO-1 CPU-Adam loss
    differences (+21%, +12.6%) are far inside their rtol and are not regressions."""
    base = results_format.load_benchmarks(H200_X1 / "ds-0.19.6")
    new = results_format.load_benchmarks(H200_X1 / "ds-0.19.8")
    result = compare.compare(base, new)
    names = {c.name for c in result.of(compare.REGRESSION, compare.METRIC)}
    assert not [n for n in names if "loss_max_rel_diff" in n], names
    grown = [c for c in result.changes if c.name.startswith(
        "ZERO-EQ-1[cuda-z1-off_opt-bf16-cpu_adam-gas1-ws1]::zero.loss_max_rel_diff")]
    assert grown and grown[0].kind == compare.UNCHANGED and grown[0].bound == 1.6e-2
    main(["compare", str(H200_X1 / "ds-0.19.6"), str(H200_X1 / "ds-0.19.8"), "--markdown"])
    shown = capsys.readouterr().out
    assert "| ZERO-EQ-1[cuda-z1-off_opt-bf16-cpu_adam-gas1-ws1]::zero.loss_max_rel_diff" \
        not in shown
