"""``--soak MINUTES`` in the plugin: without it a test marked ``soak`` is never made (the collected
ids and their count are unchanged); with it the test is collected after every other test but
``run_last``; on a node without GPUs a run with ``--soak`` is refused (a usage error, never a pass
or "no tests ran"), as is a MINUTES that is not above 0; a run's ``soak`` fact becomes
summary.json's ``soak`` section and the ``dsconform_soak_*`` series of dsconform.prom.

Each test runs a small pytest session (pytester, in-process) against the real plugin on this
machine, which has no GPU.
"""

from __future__ import annotations

import json

import pytest

SUITE = '''
import pytest

CAPABILITY = "demo"

@pytest.mark.run_last
def test_gate_at_end():
    pass

@pytest.mark.soak
def test_burn_in(run):
    assert run.soak_minutes > 0

def test_plain():
    pass

def test_says_from_a_thread(run):
    import threading
    t = threading.Thread(target=run.say, args=("soak 1/2 min: GPU 0 3 it 0 mism 61 C",))
    t.start()
    t.join()

def test_records_a_soak(facts):
    facts.record("soak", {"minutes": 1, "elapsed_s": 61.0, "passed": False,
                          "problems": ["GPU 1 (PCI 0000:2a:00.0, rank 1): ..."],
                          "gpus": [{"gpu": 1, "bus_id": "0000:2a:00.0", "iterations": 3,
                                    "mismatches": 1, "drift_pct": 2.5, "throttle": {},
                                    "findings": []}]})
'''


@pytest.fixture
def run(pytester, tmp_path):
    pytester.makepyfile(test_demo=SUITE)
    profile = tmp_path / "p0.toml"
    profile.write_text('[profile]\nname = "p0"\n[gpus]\ncount = 0\n')

    def _run(*args):
        return pytester.runpytest("-p", "fixtures.plugin", "--strict-markers", "-p",
                                  "no:cacheprovider", "--profile", str(profile),
                                  "--results", str(pytester.path / "results"), *args)
    return _run


def test_without_soak_the_soak_test_is_not_collected(run):
    result = run("--collect-only", "-q")
    assert result.ret == 0
    ids = [line.rsplit("/", 1)[-1] for line in result.outlines if "::" in line]
    assert ids == ["test_demo.py::test_plain", "test_demo.py::test_says_from_a_thread",
                   "test_demo.py::test_records_a_soak", "test_demo.py::test_gate_at_end"]
    result.stdout.fnmatch_lines(["4 tests collected in *"])


def test_with_soak_it_is_collected_after_every_test_but_the_gate_at_the_end(run):
    result = run("--collect-only", "-q", "--soak", "1")
    assert result.ret == 0
    ids = [line.rsplit("/", 1)[-1] for line in result.outlines if "::" in line]
    assert ids == ["test_demo.py::test_plain", "test_demo.py::test_says_from_a_thread",
                   "test_demo.py::test_records_a_soak", "test_demo.py::test_burn_in",
                   "test_demo.py::test_gate_at_end"]


def test_soak_on_a_node_without_gpus_is_refused(run, pytester):
    result = run("--soak", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--soak 1: a burn-in runs on GPUs and this node has none*"])
    summary = json.loads((pytester.path / "results" / "summary.json").read_text())
    assert summary["status"] == "refused"


@pytest.mark.parametrize("minutes", ["0", "-5"])
def test_soak_minutes_must_be_above_0(run, minutes):
    result = run("--collect-only", "--soak", minutes)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--soak {minutes}: MINUTES must be a number above 0*"])


def test_the_soak_fact_becomes_the_summary_section_and_prometheus_series(run, pytester):
    result = run("-k", "records_a_soak")
    assert result.ret == 0
    out = pytester.path / "results"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["soak"]["gpus"][0]["mismatches"] == 1
    prom = (out / "dsconform.prom").read_text()
    assert 'dsconform_soak_mismatches{bus_id="0000:2a:00.0",gpu="1"} 1.0' in prom
    assert 'dsconform_soak_throughput_drift_ratio{bus_id="0000:2a:00.0",gpu="1"} 0.025' in prom
    assert "dsconform_soak_passed 0.0" in prom


def test_the_progress_line_reaches_the_console_from_another_thread(run):
    result = run("-k", "says")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["dsconform: soak 1/2 min: GPU 0 3 it 0 mism 61 C"])


def test_a_run_without_a_soak_has_no_soak_section(run, pytester):
    assert run("-k", "plain").ret == 0
    out = pytester.path / "results"
    assert "soak" not in json.loads((out / "summary.json").read_text())
    assert "dsconform_soak_" not in (out / "dsconform.prom").read_text()
