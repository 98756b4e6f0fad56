"""dsconform compare: direction, noise, limits, outcomes, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from dsconform import compare, records
from dsconform.cli import main


def doc(metrics, outcomes=(), ds="0.19.6"):
    ms = [records.Metric(f"t.py::{name}", name, samples, unit, better, limit, {})
          for name, samples, unit, better, limit in metrics]
    os_ = [records.Outcome(nodeid, outcome, "c", reason) for nodeid, outcome, reason in outcomes]
    return records.document(ms, os_, machine_info={"deepspeed": ds}, commit_info={},
                            profile={"name": "p"})


def kinds(base, new, **kw):
    return {c.name.split("::")[-1]: c.kind for c in compare.compare(base, new, **kw).changes}


def test_direction_decides_regression():
    base = doc([("bw", [300.0], "GB/s", "higher", None), ("t", [10.0], "s", "lower", None)])
    worse = doc([("bw", [250.0], "GB/s", "higher", None), ("t", [12.0], "s", "lower", None)])
    better = doc([("bw", [350.0], "GB/s", "higher", None), ("t", [8.0], "s", "lower", None)])
    assert kinds(base, worse) == {"bw": "regression", "t": "regression"}
    assert kinds(base, better) == {"bw": "improvement", "t": "improvement"}


def test_small_changes_and_noise_are_unchanged():
    base = doc([("bw", [300.0], "GB/s", "higher", None)])
    assert kinds(base, doc([("bw", [280.0], "GB/s", "higher", None)])) == {"bw": "unchanged"}
    noisy_base = doc([("bw", [200.0, 300.0, 400.0], "GB/s", "higher", None)])
    noisy_new = doc([("bw", [150.0, 200.0, 250.0], "GB/s", "higher", None)])  # -33%, noise 100%
    assert kinds(noisy_base, noisy_new) == {"bw": "unchanged"}
    quiet_base = doc([("bw", [299.0, 300.0, 301.0], "GB/s", "higher", None)])
    quiet_new = doc([("bw", [199.0, 200.0, 201.0], "GB/s", "higher", None)])
    assert kinds(quiet_base, quiet_new) == {"bw": "regression"}


def test_crossing_the_limit_is_a_regression_however_small():
    base = doc([("bw", [300.0], "GB/s", "higher", 299.0)])
    new = doc([("bw", [298.0], "GB/s", "higher", 299.0)])
    assert kinds(base, new) == {"bw": "regression"}


def test_drift_from_exact_is_reported():
    base = doc([("diff", [0.0], "1", "lower", None)])
    assert kinds(base, doc([("diff", [1e-7], "1", "lower", None)])) == {"diff": "regression"}
    assert kinds(base, doc([("diff", [0.0], "1", "lower", None)])) == {"diff": "unchanged"}


def test_outcomes_lost_and_regained():
    base = doc([], [("t.py::onebit", "passed", ""), ("t.py::zero", "failed", "x"),
                    ("t.py::old", "passed", "")])
    new = doc([], [("t.py::onebit", "skipped", "Requires: [DeepSpeed<0.19.7 (found 0.19.8)]"),
                   ("t.py::zero", "passed", ""), ("t.py::added", "passed", "")])
    got = {c.name: (c.kind, c.detail) for c in compare.compare(base, new).changes}
    assert got["t.py::onebit"] == ("regression", "passed -> skipped: Requires: [DeepSpeed<0.19.7 "
                                                 "(found 0.19.8)]")
    assert got["t.py::zero"][0] == "improvement"
    assert got["t.py::added"][0] == "new" and got["t.py::old"][0] == "gone"


def test_cli_exit_codes(tmp_path, capsys):
    base, same, worse = (tmp_path / n for n in ("base.json", "same.json", "worse.json"))
    base.write_text(json.dumps(doc([("bw", [300.0], "GB/s", "higher", None)])))
    same.write_text(json.dumps(doc([("bw", [301.0], "GB/s", "higher", None)], ds="0.19.8")))
    worse.write_text(json.dumps(doc([("bw", [100.0], "GB/s", "higher", None)], ds="0.19.8")))
    assert main(["compare", str(base), str(same)]) == 0
    assert main(["compare", str(base), str(worse)]) == 1
    out = capsys.readouterr().out
    assert "regression (1):" in out and "300 -> 100 GB/s" in out and "deepspeed 0.19.8" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["compare", str(base), str(bad)]) == 2
    assert main(["compare", str(base), str(tmp_path / "missing.json")]) == 2
    (tmp_path / "nolist.json").write_text("{}")
    assert main(["compare", str(base), str(tmp_path / "nolist.json")]) == 2
    assert "no 'benchmarks' list" in capsys.readouterr().err


def test_reads_a_real_results_file():
    ref = (Path(__file__).parent.parent
           / "results/reference/h200-x2/zero-fp16-after-fix/benchmarks.json")
    d = compare.load(ref)
    result = compare.compare(d, d)
    assert not result.regressed and result.of("unchanged")
