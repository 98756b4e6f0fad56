"""dsconform compare on crafted inputs: direction, noise, limits, rates, outcomes, stable ids,
known issues, facts, environment, malformed input, exit codes."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from dsconform.cli import main
from dsconform.results import compare, records
from dsconform.results import format as results_format
from tests.compare_docs import ISSUE, doc, metric, outcome, rate, write

# Real results files of 2xH200 runs, trimmed (tests/data/compare/README.md).
REFERENCE = Path(__file__).parents[1] / "data" / "compare"
ZERO_MUST = "ZERO-EQ-1: ZeRO MUST give DDP's losses."


def kinds(base, new, area=compare.METRIC, **kw):
    return {c.name.split("::")[-1]: c.kind
            for c in compare.compare(base, new, **kw).changes if c.area == area}


def one(base, new, name, **kw):
    [c] = [c for c in compare.compare(base, new, **kw).changes if c.name.endswith(name)]
    return c


# ------------------------------------------------------------------ metrics

def test_direction_decides_regression_and_improvement():
    base = doc([metric("bw", [300.0] * 3, "GB/s", "higher"), metric("t", [10.0] * 3)])
    worse = doc([metric("bw", [250.0] * 3, "GB/s", "higher"), metric("t", [12.0] * 3)])
    better = doc([metric("bw", [350.0] * 3, "GB/s", "higher"), metric("t", [8.0] * 3)])
    assert kinds(base, worse) == {"bw": "regression", "t": "regression"}
    assert kinds(base, better) == {"bw": "improvement", "t": "improvement"}


def robust(samples):
    """noise.spread, written out: 1.4826 x the median absolute deviation."""
    m = statistics.median(samples)
    return 1.4826 * statistics.median(abs(v - m) for v in samples)


def test_small_changes_and_noise_are_unchanged():
    base = doc([metric("bw", [300.0] * 3, "GB/s", "higher")])
    assert kinds(base, doc([metric("bw", [280.0] * 3, "GB/s", "higher")])) == {
        "bw": "unchanged"}
    noisy_base = doc([metric("bw", [200.0, 300.0, 400.0], "GB/s", "higher")])
    noisy_new = doc([metric("bw", [150.0, 200.0, 250.0], "GB/s", "higher")])  # -33%
    c = one(noisy_base, noisy_new, "bw")
    pooled = math.sqrt((robust([200, 300, 400]) ** 2 + robust([150, 200, 250]) ** 2) / 2)
    assert c.kind == "unchanged" and c.noise_known and c.band == pytest.approx(3 * pooled / 300)
    quiet_base = doc([metric("bw", [299.0, 300.0, 301.0], "GB/s", "higher")])
    quiet_new = doc([metric("bw", [199.0, 200.0, 201.0], "GB/s", "higher")])
    c = one(quiet_base, quiet_new, "bw")
    assert c.kind == "regression" and c.band == pytest.approx(0.10)
    assert "-33.3%" in c.detail and "noise band ±10.0%" in c.detail


def test_one_round_says_its_noise_is_unknown():
    """A value measured once that is not a timing (a loss: deterministic on one stack) is held
    to the threshold; a timing measured once is not judged: its noise was never measured."""
    c = one(doc([metric("loss", [10.0], "1")]), doc([metric("loss", [12.0], "1")]), "loss")
    assert c.kind == "regression" and not c.noise_known
    assert "noise unknown: 1 round; threshold ±10.0%" in c.detail
    c = one(doc([metric("t", [10.0])]), doc([metric("t", [20.0])]), "t")
    assert c.kind == "not judged" and "noise unknown: 1 round (a timing is judged from 3)" in (
        c.detail)


def test_threshold_is_configurable():
    base, new = doc([metric("t", [10.0] * 3)]), doc([metric("t", [10.6] * 3)])
    assert kinds(base, new) == {"t": "unchanged"}
    assert kinds(base, new, threshold=0.05) == {"t": "regression"}
    with pytest.raises(ValueError, match="threshold"):
        compare.compare(base, new, threshold=-1)


def test_crossing_the_limit_is_a_regression_however_small():
    base = doc([metric("bw", [300.0], "GB/s", "higher", 299.0)])
    new = doc([metric("bw", [298.0], "GB/s", "higher", 299.0)])
    c = one(base, new, "bw")
    assert c.kind == "regression" and c.beyond == "beyond its floor 299 GB/s"


def test_drift_from_exact_is_reported():
    base = doc([metric("diff", [0.0], "1")])
    c = one(base, doc([metric("diff", [1e-7], "1")]), "diff")
    assert (c.kind, c.change) == ("regression", "from 0")
    assert kinds(base, doc([metric("diff", [0.0], "1")])) == {"diff": "unchanged"}


def test_from_0_within_the_new_rounds_spread_is_noise_and_beyond_it_is_drift():
    """A per-rank wait of 0 % in one run and 0/5/9 % in the next is noise (seen on 2xH200);
    0 -> 4/5/6 % in three steady rounds is drift."""
    base = doc([metric("wait", [0.0, 0.0, 0.0], "%")])
    assert kinds(base, doc([metric("wait", [0.0, 4.9, 9.2], "%")])) == {"wait": "unchanged"}
    c = one(base, doc([metric("wait", [4.0, 5.0, 6.0], "%")]), "wait")
    assert (c.kind, c.change) == ("regression", "from 0")


def test_differing_parameters_are_not_comparable_and_named():
    base = doc([metric("bw", [300.0], "GB/s", "higher", bytes=2**30)])
    new = doc([metric("bw", [300.0], "GB/s", "higher", bytes=2**32)])
    c = one(base, new, "bw")
    assert c.kind == "not comparable" and "bytes 1073741824 -> 4294967296" in c.detail
    # ...and the summary line counts it: a parameter change cannot hide a metric silently.
    from dsconform.results.render.compare import tally

    assert tally(compare.compare(base, new)).endswith(
        "; NOT COMPARED: 1 metrics (see 'Not comparable')")


def test_a_tolerance_override_does_not_make_a_measured_difference_incomparable():
    """rtol/atol say how a value was judged, not what was measured: a profile override in one
    run leaves the ZeRO differences comparable, and the detail names the other bounds."""
    base = doc([metric("zero.grad_max_abs_diff", [1e-3], "1", "lower", stage=2, rtol=0.016)])
    new = doc([metric("zero.grad_max_abs_diff", [3e-3], "1", "lower", stage=2, rtol=0.02)])
    c = one(base, new, "zero.grad_max_abs_diff")
    assert c.kind == "regression" and c.detail.endswith(
        "; judged under other bounds: rtol 0.016 -> 0.02"), c.detail
    moved = doc([metric("zero.grad_max_abs_diff", [1e-3], "1", "lower", stage=3, rtol=0.016)])
    assert one(base, moved, "zero.grad_max_abs_diff").kind == "not comparable"


def test_infinite_and_nan_values_do_not_break_the_comparison():
    # A diverged ZeRO comparison records inf (tests/data/compare/zero-full).
    base = doc([metric("g", [math.inf], "1"), metric("n", [1.0], "1")])
    new = doc([metric("g", [0.3], "1"), metric("n", [math.nan], "1")])
    got = {c.name.split("::")[-1]: c for c in compare.compare(base, new).changes}
    assert (got["g"].kind, got["g"].change) == ("improvement", "from inf")
    assert got["n"].kind == "not comparable" and "not a number" in got["n"].detail


# ------------------------------------------------------------------ rates

GIB = 2**30


def test_rates_are_compared_as_rates_higher_is_better():
    # 1 GiB in 4 ms = 268 GB/s; in 5 ms = 215 GB/s: the seconds went UP, the rate DOWN.
    base = doc([rate("busbw", [0.004, 0.004, 0.004], GIB, bytes=GIB)])
    slower = doc([rate("busbw", [0.005, 0.005, 0.005], GIB, bytes=GIB)])
    faster = doc([rate("busbw", [0.003, 0.003, 0.003], GIB, bytes=GIB)])
    c = one(base, slower, "busbw")
    assert c.kind == "regression" and c.better == "higher"
    assert (c.base, c.new, c.change) == ("268.4 GB/s", "214.7 GB/s", "-20.0%")
    assert one(base, faster, "busbw").kind == "improvement"


def test_rate_noise_comes_from_the_rate_samples():
    noisy = doc([rate("busbw", [0.003, 0.005, 0.008], GIB)])  # median 215 GB/s, wide spread
    steady = doc([rate("busbw", [0.004, 0.004, 0.004], GIB)])
    c = one(noisy, steady, "busbw")
    rates = [GIB / 1e9 / s for s in (0.003, 0.005, 0.008)]
    band = 3 * math.sqrt(robust(rates) ** 2 / 2) / statistics.median(rates)
    assert c.kind == "unchanged" and c.band == pytest.approx(band)


def test_one_wild_round_cannot_widen_the_band():
    """Each run's noise is the robust spread of its rounds: NEW slower with one wild round
    ([300, 301, 299] -> [180, 185, 300] GB/s, -38%) is a regression, not "within noise" of
    the wild round."""
    amount = 300e9
    base = doc([rate("busbw", [amount / 1e9 / g for g in (300, 301, 299)], amount)])
    new = doc([rate("busbw", [amount / 1e9 / g for g in (180, 185, 300)], amount)])
    c = one(base, new, "busbw")
    assert c.kind == "regression" and c.band == pytest.approx(0.10), c


def test_rate_below_its_floor_is_a_regression():
    base = doc([rate("busbw", [0.004] * 3, GIB, floor=265.0)])
    new = doc([rate("busbw", [0.00406] * 3, GIB, floor=265.0)])  # 264.4 GB/s: -1.5%
    c = one(base, new, "busbw")
    assert c.kind == "regression" and c.beyond == "beyond its floor 265 GB/s"


def test_old_format_gbps_in_stats_compares_with_a_new_rate():
    old = doc([metric("busbw", [268.4, 268.0, 268.8], "GB/s", "higher", test="t.py::test_bw",
                      bytes=GIB)])
    new = doc([rate("busbw", [0.005] * 3, GIB, bytes=GIB)])
    c = one(old, new, "busbw")
    assert c.kind == "regression" and (c.base, c.new) == ("268.4 GB/s", "214.7 GB/s")


# ------------------------------------------------------------------ outcomes and stable ids

def test_outcomes_lost_regained_new_and_vanished():
    base = doc(outcomes=[outcome("t.py::onebit", "passed"), outcome("t.py::zero", "failed", "x"),
                         outcome("t.py::old", "passed"), outcome("t.py::flaky", "skipped", "r"),
                         outcome("t.py::broke", "passed")])
    new = doc(outcomes=[
        outcome("t.py::onebit", "skipped", "Requires: [DeepSpeed<0.19.7 (found 0.19.8)]"),
        outcome("t.py::zero", "passed"), outcome("t.py::added", "passed"),
        outcome("t.py::added_failing", "failed", "AssertionError: new check"),
        outcome("t.py::broke", "failed", "AssertionError: boom")])
    got = {c.name: (c.kind, c.detail) for c in compare.compare(base, new).changes}
    assert got["t.py::added_failing"] == ("regression", "failed: AssertionError: new check (a "
                                                        "test BASE did not run)")
    assert got["t.py::onebit"] == ("regression", "passed -> skipped: Requires: [DeepSpeed<0.19.7 "
                                                 "(found 0.19.8)]")
    assert got["t.py::broke"] == ("regression", "passed -> failed: AssertionError: boom")
    assert got["t.py::zero"][0] == "improvement"
    assert got["t.py::added"][0] == "new"
    assert got["t.py::old"] == ("regression", "passed -> not run: not in NEW's results")
    assert got["t.py::flaky"][0] == "vanished"


@pytest.mark.parametrize("before, after, kind", [
    ("passed", "xfailed", "regression"),   # broken upstream now (a known issue)
    ("xfailed", "passed", "improvement"),  # fixed upstream
    ("xfailed", "xpassed", "improvement"),  # fixed, the registry still claims it
    ("xfailed", "failed", "regression"),   # a known issue's range ended, or it fails otherwise
    ("skipped", "failed", "regression"),   # did not run before; fails now
    ("skipped", "passed", "improvement"),
    ("failed", "error", "changed"),
    ("passed", "passed", "unchanged"),
])
def test_outcome_transitions(before, after, kind):
    base = doc(outcomes=[outcome("t.py::x", before)])
    new = doc(outcomes=[outcome("t.py::x", after)])
    assert kinds(base, new, area=compare.OUTCOME) == {"x": kind}


def test_stable_id_is_the_conformance_id_and_case():
    assert compare.conformance_id(ZERO_MUST) == "ZERO-EQ-1"
    assert compare.conformance_id("ZeRO MUST match DDP.") is None
    assert compare.conformance_id("LOSS-SCALE-1: ...") == "LOSS-SCALE-1"
    assert compare.stable_id("suites/test_zero.py::test_zero_matches_ddp[cpu-z3-a]",
                             ZERO_MUST) == "ZERO-EQ-1[cpu-z3-a]"
    assert compare.stable_id("suites/t.py::test_plain", "plain words") == "suites/t.py::test_plain"


def test_renamed_test_still_matches_by_conformance_id():
    base = doc([metric("loss", [1e-3], "1", test="suites/test_zero.py::test_zero[cpu-z3]")],
               [outcome("suites/test_zero.py::test_zero[cpu-z3]", "passed", must=ZERO_MUST)])
    new = doc([metric("loss", [5e-3], "1", test="suites/test_zero2.py::test_renamed[cpu-z3]")],
              [outcome("suites/test_zero2.py::test_renamed[cpu-z3]", "failed", "boom",
                       must=ZERO_MUST)])
    got = {(c.name, c.kind) for c in compare.compare(base, new).changes}
    assert ("ZERO-EQ-1[cpu-z3]", "regression") in got  # the outcome, matched across the rename
    assert ("ZERO-EQ-1[cpu-z3]::loss", "regression") in got  # its metric too
    assert ("ZERO-EQ-1[cpu-z3]", "renamed") in got
    assert not [c for c in compare.compare(base, new).changes if c.kind in ("new", "vanished")]


def test_a_shared_conformance_id_falls_back_to_node_ids():
    two = [outcome("t.py::a", "passed", must="X-1: a"), outcome("t.py::b", "passed", must="X-1: b")]
    run = compare.read_run(doc(outcomes=two))
    assert set(run.outcomes) == {"t.py::a", "t.py::b"}


# ------------------------------------------------------------------ known issues

def test_known_issue_that_appeared_and_its_case_regressed():
    case = "suites/test_zero.py::test_z[cpu-z0-fp16]"
    base = doc(outcomes=[outcome(case, "passed", must=ZERO_MUST)])
    new = doc(outcomes=[outcome(case, "xfailed", "known upstream issue", ZERO_MUST,
                                "DS-1-BROKEN")], known_issues=[{**ISSUE, "count": 1}],
              deepspeed="0.19.8")
    result = compare.compare(base, new)
    [issue] = result.of("new", compare.KNOWN_ISSUE)
    assert issue.name == "DS-1-BROKEN" and "appeared on DeepSpeed 0.19.8: 1 cases" in issue.detail
    assert "https://x/1" in issue.detail
    [case_change] = result.of("regression", compare.OUTCOME)
    assert "xfailed [known issue DS-1-BROKEN]" in case_change.detail


def test_known_issue_that_went_away_says_fixed_upstream_or_still_failing():
    cases = [f"suites/test_zero.py::test_z[cpu-z0-{i}]" for i in range(3)]
    base = doc(outcomes=[outcome(c, "xfailed", "", ZERO_MUST, "DS-1-BROKEN") for c in cases],
               known_issues=[{**ISSUE, "count": 3}])
    fixed = doc(outcomes=[outcome(c, "passed", must=ZERO_MUST) for c in cases],
                deepspeed="0.19.9")
    result = compare.compare(base, fixed)
    [gone] = result.of("vanished", compare.KNOWN_ISSUE)
    assert "fixed upstream: its cases pass on DeepSpeed 0.19.9" in gone.detail
    assert "3 passed" in gone.detail
    assert len(result.of("improvement", compare.OUTCOME)) == 3 and not result.regressed
    still = doc(outcomes=[outcome(c, "failed", "boom", ZERO_MUST) for c in cases],
                deepspeed="0.19.9")
    [gone] = compare.compare(base, still).of("vanished", compare.KNOWN_ISSUE)
    assert "still fail there: verify, then widen the entry" in gone.detail


# ------------------------------------------------------------------ facts (defaults)

DEF = "suites/test_zero.py::test_effective_defaults"
DEF_MUST = "ZERO-DEF-1: DeepSpeed's effective defaults MUST equal the ones the suite assumes."


def defaults(clipping, **machine):
    facts = [records.Fact(DEF, "default.gradient_clipping", clipping, "zero"),
             records.Fact(DEF, "default.adam.betas", [0.9, 0.999], "zero")]
    return doc(outcomes=[outcome(DEF, "passed", must=DEF_MUST)], facts=facts, **machine)


def test_a_default_that_moved_is_named_and_is_no_regression_by_itself():
    result = compare.compare(defaults(0.0), defaults(1.0, deepspeed="0.19.8"))
    [moved] = result.of("changed", compare.FACT)
    assert (moved.name, moved.base, moved.new) == ("ZERO-DEF-1::default.gradient_clipping",
                                                   "0.0", "1.0")
    assert len(result.of("unchanged", compare.FACT)) == 1 and not result.regressed


def test_runs_without_facts_say_defaults_were_not_compared():
    old = doc(outcomes=[outcome(DEF, "passed", must=DEF_MUST)], with_facts=False)
    result = compare.compare(old, defaults(1.0))
    assert not result.of("changed", compare.FACT)
    assert result.notes == ["BASE recorded no facts (written by an older dsconform): "
                            "DeepSpeed's effective defaults were not compared"]


def test_runs_where_the_defaults_test_did_not_run_say_defaults_were_not_compared():
    """The 2xH200 upgrade pair recorded no facts (ZERO-DEF-1 was not in -m gpu): "nothing
    silently changed" must not be all the comparison says."""
    ran_elsewhere = doc(outcomes=[outcome("t.py::x", "passed")])
    for base, new, who in ((ran_elsewhere, ran_elsewhere, "BASE and NEW"),
                           (ran_elsewhere, defaults(1.0), "BASE"),
                           (defaults(1.0), ran_elsewhere, "NEW")):
        result = compare.compare(base, new)
        assert not result.of("vanished", compare.FACT) and not result.of("new", compare.FACT)
        assert result.notes == [f"{who} recorded no facts (the defaults test ZERO-DEF-1 did not "
                                "run, or ended before recording): DeepSpeed's effective "
                                "defaults were not compared"]


# ------------------------------------------------------------------ environment

def test_environment_rows_and_hardware_warnings():
    base = doc()
    new = doc(deepspeed="0.19.8", gpu_model="NVIDIA H100 80GB HBM3", gpu_count=8,
              profile="h100-x8")
    result = compare.compare(base, new)
    assert result.base.env["DeepSpeed"] == "0.19.6" and result.new.env["DeepSpeed"] == "0.19.8"
    assert result.new.env["GPU"] == "8x NVIDIA H100 80GB HBM3"
    assert set(result.base.env) == {"DeepSpeed", "torch", "CUDA", "NCCL", "driver", "GPU",
                                    "profile", "python", "node"}
    assert result.warnings == [
        "different profile: BASE 'h200-x2', NEW 'h100-x8'",
        "different GPU: BASE '2x NVIDIA H200', NEW '8x NVIDIA H100 80GB HBM3'"]
    assert compare.compare(base, doc(deepspeed="0.19.8")).warnings == []


# The CLI refuses a run that recorded nothing (test_a_run_that_ran_nothing_...): one outcome.
RAN = [outcome("t.py::x", "passed")]


def test_cli_different_hardware_warns_and_exits_2_only_with_strict(tmp_path, capsys):
    base = write(tmp_path / "b.json", doc(outcomes=RAN))
    cpu = write(tmp_path / "n.json", doc(outcomes=RAN, gpu_model=None, gpu_count=0,
                                         profile="cpu-ci"))
    assert main(["compare", base, cpu]) == 0
    out = capsys.readouterr().out
    assert "WARNING: these runs are of DIFFERENT HARDWARE" in out and "cpu-ci" in out
    assert main(["compare", base, cpu, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsconform compare: --strict: the runs are of different hardware")
    assert main(["compare", base, base, "--strict"]) == 0
    capsys.readouterr()
    # With the markdown on stdout, the warning goes where a person sees it.
    assert main(["compare", base, cpu, "--markdown"]) == 0
    captured = capsys.readouterr()
    assert "> **WARNING: these runs are of DIFFERENT HARDWARE" in captured.out
    assert "dsconform compare: WARNING: different profile: BASE 'h200-x2', NEW 'cpu-ci'" in (
        captured.err)


# ------------------------------------------------------------------ exit codes, bad input

def test_cli_exit_codes(tmp_path, capsys):
    base = write(tmp_path / "base.json", doc([metric("bw", [300.0] * 3, "GB/s", "higher")]))
    same = write(tmp_path / "same.json", doc([metric("bw", [301.0] * 3, "GB/s", "higher")],
                                             deepspeed="0.19.8"))
    worse = write(tmp_path / "worse.json", doc([metric("bw", [100.0] * 3, "GB/s", "higher")],
                                               deepspeed="0.19.8"))
    assert main(["compare", base, same]) == 0
    assert "no regression" in capsys.readouterr().out
    assert main(["compare", base, worse]) == 1
    out = capsys.readouterr().out
    assert "== What got slower or drifted (1) ==" in out and "300 GB/s" in out
    assert "100 GB/s" in out and "REGRESSION: 1 (0 outcomes, 1 metrics)" in out
    assert "0.19.8" in out


def test_cli_accepts_a_results_directory(tmp_path):
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "benchmarks.json", doc(outcomes=RAN))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def _bad_docs():
    good = doc([metric("bw", [1.0], "GB/s", "higher")], [outcome("t.py::x", "passed")])

    def broken(path, value):
        d = json.loads(json.dumps(good))
        *parents, last = path
        target = d
        for p in parents:
            target = target[p]
        target[last] = value
        return d

    return [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a benchmark JSON (no 'benchmarks' list)"),
        ("{}", "not a benchmark JSON (no 'benchmarks' list)"),
        (json.dumps({"capabilities": {}, "failures": []}), "this is a summary.json"),
        (json.dumps(broken(["benchmarks", 0, "stats", "median"], "fast")),
         "benchmarks[0].stats.median: expected a number, found \"fast\""),
        (json.dumps(broken(["benchmarks", 0, "stats"], None)),
         "benchmarks[0].stats: expected an object"),
        (json.dumps(broken(["benchmarks", 0, "fullname"], 7)),
         "benchmarks[0].fullname: expected a string, found 7"),
        (json.dumps(broken(["benchmarks", 0, "extra_info", "better"], "up")),
         "benchmarks[0].extra_info.better: expected 'lower' or 'higher', found \"up\""),
        (json.dumps(broken(["benchmarks", 0, "extra_info", "rate"], {"unit": "GB/s",
                                                                     "median": 1.0,
                                                                     "samples": []})),
         "benchmarks[0].extra_info.rate.samples: expected a non-empty list of numbers"),
        (json.dumps(broken(["dsconform", "outcomes", 0, "outcome"], "exploded")),
         "dsconform.outcomes[0].outcome: expected one of passed"),
        (json.dumps(broken(["dsconform", "outcomes"], {"t": "passed"})),
         "dsconform.outcomes: expected a list"),
        (json.dumps(broken(["dsconform", "facts"], [{"name": "x"}])),
         "dsconform.facts[0].nodeid: expected a string, found null"),
        (json.dumps(broken(["machine_info"], "vm")), "machine_info: expected an object"),
        (json.dumps({k: v for k, v in good.items() if k != "dsconform"}),
         "a pytest-benchmark file without dsconform outcomes (no 'dsconform' section): not a "
         "suite run"),
        (b"\xff\xfe\x00", "cannot read"),
    ]


@pytest.mark.parametrize("content, message", [
    pytest.param(c, m, id=m.split(":")[0].split(" (")[0]) for c, m in _bad_docs()])
def test_malformed_or_foreign_input_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    good = write(tmp_path / "good.json", doc())
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    for args in ([good, str(bad)], [str(bad), good]):
        assert main(["compare", *args]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"dsconform compare: {bad}: ") and message in lines[0]


def test_unwritable_outputs_are_one_line_and_exit_2(tmp_path, capsys):
    good = write(tmp_path / "good.json", doc(outcomes=RAN))
    missing_dir = tmp_path / "no" / "such"
    assert main(["compare", good, good, "--markdown", str(missing_dir / "x.md")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"dsconform compare: cannot write {missing_dir / 'x.md'}: No such file or "
                   "directory"]


@pytest.mark.parametrize("empty_side", ["base", "new"])
def test_a_run_that_ran_nothing_is_refused_not_compared(tmp_path, capsys, empty_side):
    """A --collect-only run (or a selection that matched nothing) writes no outcome and no
    metric: comparing it would print "no regression" having compared nothing."""
    ran = write(tmp_path / "ran.json", doc([metric("bw", [1.0], "GB/s", "higher")], RAN))
    empty = write(tmp_path / "empty.json", doc())
    args = [empty, ran] if empty_side == "base" else [ran, empty]
    assert main(["compare", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"dsconform compare: {empty}: the run recorded no test outcome and no measurement: "
        "nothing to compare (a --collect-only run, a selection that matched nothing, or a run "
        "stopped before its first test ended)"]


@pytest.mark.parametrize("name", ["junit.xml", "records.jsonl"])
def test_another_results_file_names_the_benchmarks_json(tmp_path, capsys, name):
    good = write(tmp_path / "good.json", doc(outcomes=RAN))
    other = tmp_path / name
    other.write_text("<testsuites/>" if name.endswith(".xml") else '{"a": 1}\n{"b": 2}\n')
    assert main(["compare", good, str(other)]) == 2
    assert "give the benchmarks.json beside it" in capsys.readouterr().err


def test_missing_file_and_bad_threshold(tmp_path, capsys):
    good = write(tmp_path / "good.json", doc())
    assert main(["compare", good, str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    assert main(["compare", good, good, "--threshold", "-0.1"]) == 2
    assert "--threshold -0.1: must be a number >= 0" in capsys.readouterr().err
    ran = write(tmp_path / "ran.json", doc(outcomes=RAN))
    assert main(["compare", ran, ran, "--threshold", "5"]) == 0  # 500%, as typed, but said
    assert ("dsconform compare: note: --threshold 5 is 500%, a fraction (0.1 = 10%)"
            in capsys.readouterr().err)


# ------------------------------------------------------------------ real files

@pytest.mark.parametrize("folder", ["zero-full", "zero-fp16-after-fix", "ops-arch-9.0a"])
def test_reads_the_reference_results(folder):
    d = results_format.load_benchmarks(REFERENCE / folder)
    result = compare.compare(d, d)
    assert not result.regressed and result.of("unchanged")
    assert not [c for c in result.changes if c.kind not in ("unchanged",)]


def test_reference_runs_compare_across_the_fp16_fix():
    """The void fp16 rows of zero-full (inf differences) against the re-run after the DDP
    reference was fixed: the fp16 stage 1-3 cells are fixed, the stage 0 ones are not."""
    result = compare.compare(results_format.load_benchmarks(REFERENCE / "zero-full"),
                             results_format.load_benchmarks(REFERENCE / "zero-fp16-after-fix"))
    fixed = {c.name for c in result.of("improvement", compare.OUTCOME)}
    assert "ZERO-EQ-1[cuda-z3-off_none-fp16-sgd-gas1-ws2]" in fixed
    assert not any("-z0-" in name for name in fixed)
    assert result.of("unchanged", compare.OUTCOME)
