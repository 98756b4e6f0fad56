"""The known-issues registry: version-scoped strict xfails with their upstream link."""

from __future__ import annotations

import json

import pytest

from dsconform.gate import known_issues
from dsconform.gate.known_issues import KnownIssue, check_registry, issues_for

Z0 = "test_zero.py::test_zero_matches_ddp[cuda-z0-off_none-fp16-sgd-gas1-ws2]"
Z2 = "test_zero.py::test_zero_matches_ddp[cuda-z2-off_none-fp16-sgd-gas1-ws2]"


def test_the_shipped_registry_is_sound():
    assert check_registry() == []


def test_stage0_fp16_is_covered_on_the_versions_it_was_seen_on_only():
    for v in ("0.18.9", "0.19.0", "0.19.5", "0.19.6", "0.19.7", "0.19.8"):
        assert [k.id for k in issues_for(Z0, v)] == ["DS-8393-Z0-FP16-UNSCALED"]
    for v in ("0.17.6", "0.18.8", "0.19.9", "0.19.10", "0.20.0", None, "not-a-version"):
        assert issues_for(Z0, v) == [], v  # 0.19.10 is not 0.19.1: parsed, not compared as text
    assert issues_for(Z2, "0.19.8") == []
    assert issues_for(Z0.replace("cuda-", "cpu-"), "0.19.8")  # the bug is not the GPU's


def test_reason_carries_link_versions_and_what_to_do_when_fixed():
    ki = known_issues.by_id("DS-8393-Z0-FP16-UNSCALED")
    assert "https://github.com/deepspeedai/DeepSpeed/pull/8393" in ki.reason
    assert ">=0.18.9,<=0.19.8" in ki.reason and "narrow or drop the entry" in ki.reason


@pytest.mark.parametrize("change, problem", [
    ({"id": "lower-case"}, "upper case"),
    ({"deepspeed": ">=0.19"}, "no upper bound"),
    ({"deepspeed": "0.19.x"}, "not a version specifier"),
    ({"link": "github.com/x"}, "https URL"),
    ({"cases": ()}, "FILE::TEST"),
    ({"failure": ""}, "failure must say how the cases fail"),
    ({"failure": "gain (0.9"}, "is not a regular expression"),
])
def test_registry_defects_are_named(change, problem):
    base = dict(id="X-1", title="t", deepspeed="<=0.19.8", link="https://x", cases=("a.py::b",),
                seen="here", failure="gain 0.9")
    [found] = check_registry((KnownIssue(**{**base, **change}),))
    assert problem in found


# A stand-in suite file named like the real one, so the shipped registry's pattern covers it.
FAKE_ZERO = '''
import pytest

@pytest.mark.parametrize("cell", ["cuda-z0-off_none-fp16-sgd-gas1-ws2",
                                  "cuda-z0-off_none-fp16-adam-gas4-ws1",
                                  "cuda-z1-off_none-fp16-sgd-gas1-ws2"])
def test_zero_matches_ddp(cell, request):
    fixed = request.config.getoption("--fixed", default=False)
    if "-z0-" in cell and not fixed:
        raise AssertionError("first diverging step 0: max rel diff 0.999")

@pytest.mark.parametrize("cell", ["cuda-z0-off_none-fp16-sgd-gas4-ws2"])
def test_zero_matches_ddp_crash(cell):
    raise TypeError("not the known bug")
'''


def test_plugin_turns_covered_cases_into_strict_xfails_and_reports_them(pytester, tmp_path):
    pytester.makepyfile(test_zero=FAKE_ZERO)
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results",
                                str(pytester.path / "res"), "-rx")
    # installed DeepSpeed is 0.19.8 (affected): two z0 cells xfail, z1 passes
    result.assert_outcomes(passed=1, xfailed=2, failed=1)
    result.stdout.fnmatch_lines(["known 2 (strict xfails: known upstream issues and limitations*",
                                 "*2 x DS-8393-Z0-FP16-UNSCALED*pull/8393*"])
    doc = json.loads((pytester.path / "res" / "benchmarks.json").read_text())
    [hit] = doc["dsconform"]["known_issues"]
    assert hit["id"] == "DS-8393-Z0-FP16-UNSCALED" and hit["count"] == 2
    assert "deepspeedai/DeepSpeed/pull/8393" in hit["link"]
    summary = json.loads((pytester.path / "res" / "summary.json").read_text())
    assert summary["known_issues"][0]["count"] == 2


def test_a_fixed_build_makes_the_strict_xfail_fail_and_says_so(pytester, tmp_path):
    pytester.makeconftest("def pytest_addoption(parser):\n"
                          "    parser.addoption('--fixed', action='store_true')\n")
    pytester.makepyfile(test_zero=FAKE_ZERO.replace("test_zero_matches_ddp_crash",
                                                    "_not_collected"))
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results",
                                "", "--fixed")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*XPASS(strict)*DS-8393-Z0-FP16-UNSCALED*narrow or drop the "
                                 "entry*"])


def test_only_the_issues_own_failure_counts_as_it():
    """A known issue expects an assertion worded as its failure; a rank that crashed (its error
    comes back as an AssertionError subclass), a hang, a NaN or another error is not it."""
    from dsconform.harness.api import RankError, RankTimeout

    ki = known_issues.by_id("DS-8393-Z0-FP16-UNSCALED")
    seen = ("cuda-z0-off_none-fp16-sgd-gas1-ws1: first diverging step 0: step 0, grad of "
            "'fc1.bias': max abs diff 0.0172, max rel diff 0.999 exceeds tolerance")
    assert ki.expects(AssertionError(seen))
    assert ki.expects(RankError("rank 0 of 2 raised AssertionError: " + seen))
    assert not ki.expects(RankError("rank 1 of 2 died (signal 11) while running the call"))
    assert not ki.expects(RankTimeout("ranks still running after 300 s: " + seen))
    assert not ki.expects(AssertionError("first diverging step 3: loss not finite (nan)"))
    assert not ki.expects(RuntimeError(seen))
    # An applied step 1/loss_scale as far: the named groups hold gain x scale to 1 (1xH200's
    # floor scaler starts at 4: 0.25x); the same words with another gain are not this issue.
    step = "rank 0 (FP16_UnfusedOptimizer), step 0 (scale {}): moved the fp32 masters {}x as far"
    assert ki.expects(AssertionError(step.format(4, 0.25)))
    assert ki.expects(AssertionError(step.format(256, 0.003907)))
    assert not ki.expects(AssertionError(step.format(256, 0.5)))
    assert not ki.expects(AssertionError(step.format(4, 0.82)))
    out = known_issues.expected_failure([ki], AssertionError(seen))
    assert isinstance(out, known_issues.KnownIssueFailure) and "DS-8393" in str(out)
    out = known_issues.expected_failure([ki], RankError("rank 1 of 2 died (signal 11)"))
    assert type(out) is AssertionError and "failed another way" in str(out)
    assert "DS-8393-Z0-FP16-UNSCALED fails matching" in str(out) and "signal 11" in str(out)


FAKE_ZERO_OTHER_FAILURES = '''
import pytest
from dsconform.harness.api import RankError, RankTimeout

@pytest.mark.parametrize("cell", ["cuda-z0-off_none-fp16-sgd-gas1-ws1",
                                  "cuda-z0-off_none-fp16-adam-gas1-ws1",
                                  "cuda-z0-off_none-fp16-fused_adam-gas1-ws1",
                                  "cuda-z0-off_none-fp16-sgd-gas4-ws1"])
def test_zero_matches_ddp(cell):
    if "-sgd-gas1" in cell:
        raise RankError("rank 0 of 1 died (signal 11) while running the call")
    if "-adam-" in cell:
        raise RankTimeout("ranks still running after 300 s")
    if "fused_adam" in cell:
        raise AssertionError("first diverging step 2: loss of step 2 not finite (nan)")
    raise AssertionError("first diverging step 0: step 0, grad of 'w': max rel diff 0.999")
'''


def test_a_covered_case_that_fails_another_way_fails(pytester, tmp_path):
    """Cells the registry covers still fail when they crash, hang or go NaN: only the issue's
    own failure is the strict xfail's (the last cell)."""
    pytester.makepyfile(test_zero=FAKE_ZERO_OTHER_FAILURES)
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results",
                                "", "-rfx")
    result.assert_outcomes(failed=3, xfailed=1)
    out = result.stdout.str()
    assert out.count("but failed another way, which the issue does not explain") >= 3, out
    for text in ("covered by known issue(s) (DS-8393-Z0-FP16-UNSCALED fails matching",
                 "RankError: rank 0 of 1 died (signal 11)", "RankTimeout: ranks still running",
                 "AssertionError: first diverging step 2: loss of step 2 not finite (nan)"):
        assert text in out, text


LONGREPR_PROBE = '''
def pytest_runtest_logreport(report):
    if report.when == "call" and hasattr(report, "wasxfail"):
        with open("xfail-reports.txt", "a") as f:
            f.write(report.nodeid + "\\n" + report.longreprtext + "\\n====\\n")
'''


def test_the_expected_failure_carries_the_checks_message_without_its_traceback(pytester,
                                                                                tmp_path):
    """pytest formats a failure's traceback even for an xfail that no report shows, parsing
    each frame's source: the expected failure holds the check's message, not its traceback."""
    pytester.makeconftest(LONGREPR_PROBE)
    pytester.makepyfile(test_zero=FAKE_ZERO.replace("test_zero_matches_ddp_crash",
                                                    "_not_collected"))
    prof = tmp_path / "p.toml"
    prof.write_text('[profile]\nname = "p"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof), "--results", "")
    result.assert_outcomes(passed=1, xfailed=2)
    text = (pytester.path / "xfail-reports.txt").read_text()
    assert text.count("DS-8393-Z0-FP16-UNSCALED: first diverging step 0: max rel diff 0.999") == 2
    assert "direct cause" not in text and 'raise AssertionError("first diverging' not in text, text


def test_every_registry_case_names_a_test_of_its_suite_file():
    """A case whose file or test name is stale (a test moved to another suite file) never
    matches: its strict xfail is lost and the release's failure shows as unexplained."""
    import ast
    import re
    from pathlib import Path

    suites = Path(__file__).resolve().parents[2] / "suites"
    tests = {p.name: {n.name for n in ast.walk(ast.parse(p.read_text()))
                      if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
             for p in suites.glob("test_*.py")}
    stale = []
    for ki in known_issues.KNOWN_ISSUES:
        for case in ki.cases:
            file, _, rest = case.partition("::")
            name = re.compile(re.escape(rest.split("[")[0]).replace(r"\*", ".*"))
            if not any(name.fullmatch(t) for t in tests.get(file, ())):
                stale.append(f"{ki.id}: {case}")
    assert not stale, "\n".join(stale)
