"""The pytest plugin end to end: gating outcomes, bad options, results files, summary, overhead.

Each test runs a small pytest session (pytester, in-process) against the real plugin and the real
node (this machine), with profiles written for the purpose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import pytest
from dsconform.gate.requires import requires

CAPABILITY = "demo"

def test_plain(metrics):
    """Plain tests MUST run, whatever the
    node.

    Not part of the statement."""
    metrics.record("answer", [41.0, 42.0, 43.0], unit="s", better="lower", limit=50.0, size=7)

@pytest.mark.gpu
def test_needs_gpu():
    pass

@requires(min_gpus=3, nccl="9.9")
def test_needs_three():
    pass

@pytest.mark.parametrize("n", [pytest.param(1, id="one"),
                               pytest.param(64, id="many", marks=requires(min_gpus=64))])
def test_param(n):
    pass

@requires(deepspeed="<0.1")
def test_old_deepspeed():
    pass
'''


def profile_file(tmp_path: Path, gpus: int) -> Path:
    path = tmp_path / f"p{gpus}.toml"
    path.write_text(f'[profile]\nname = "p{gpus}"\n[gpus]\ncount = {gpus}\n')
    return path


@pytest.fixture
def run(pytester):
    pytester.makepyfile(test_demo=SUITE)

    def _run(*args):
        return pytester.runpytest("-p", "fixtures.plugin", "--strict-markers",
                                  "--results", str(pytester.path / "results"), *args)
    return _run


def test_unpromised_needs_skip_with_reasons(run, pytester, tmp_path):
    result = run("--profile", str(profile_file(tmp_path, 0)), "-rs")
    result.assert_outcomes(passed=2, skipped=4)
    result.stdout.fnmatch_lines([
        "*Requires: ?GPUs>=1 (found 0)?*",
        "*Requires: ?GPUs>=3 (found 0) + NCCL>=9.9 (found none)?*",
        "*Requires: ?GPUs>=64 (found 0)?*",
        "*Requires: ?DeepSpeed<0.1 (found *)?*",
    ])


def test_promised_needs_fail_with_found_value(run, tmp_path):
    result = run("--profile", str(profile_file(tmp_path, 8)))
    result.assert_outcomes(passed=2, failed=2, skipped=2)
    result.stdout.fnmatch_lines(["*profile p8 promises ?GPUs>=1?: expected 8 GPUs, found 0*"])
    assert result.ret == 1


def test_gpu_tier_on_this_cpu_node_fails(run, tmp_path):
    """`-m gpu` where no GPU is found: the GPU tests skip with their reasons, and the run fails
    with one line saying why (tests/plugin/test_fail_closed.py holds the verdict files)."""
    result = run("--profile", str(profile_file(tmp_path, 0)), "-m", "gpu")
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["dsconform: no GPU found on this node (NVML: *) but -m gpu "
                                 "asks for the GPU acceptance tier"])


def test_a_cpu_run_says_so(run, tmp_path):
    result = run("--profile", str(profile_file(tmp_path, 0)), "-m", "not gpu")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["dsconform run: a CPU run: *", "run: a CPU run: *"])


def test_results_files_and_summary(run, pytester, tmp_path):
    result = run("--profile", str(profile_file(tmp_path, 0)))
    out = pytester.path / "results"
    doc = json.loads((out / "benchmarks.json").read_text())
    assert doc["machine_info"]["profile"] == "p0"
    for key in ("gpu_model", "gpu_count", "driver", "cuda", "nccl", "torch", "deepspeed"):
        assert key in doc["machine_info"]
    [bench] = doc["benchmarks"]
    assert bench["stats"]["median"] == 42.0 and bench["stats"]["rounds"] == 3
    info = bench["extra_info"]
    assert info.pop("nodeid").endswith("test_demo.py::test_plain")
    assert info == {"metric": "answer", "unit": "s", "better": "lower", "limit": 50.0,
                    "params": {"size": 7}}
    outcomes = {o["nodeid"].rsplit("/", 1)[-1]: o for o in doc["dsconform"]["outcomes"]}
    # The first paragraph, on one line: a statement wrapped over lines is kept whole.
    must = outcomes["test_demo.py::test_plain"]["must"]
    assert must == "Plain tests MUST run, whatever the node."
    assert outcomes["test_demo.py::test_needs_gpu"]["outcome"] == "skipped"
    assert outcomes["test_demo.py::test_needs_gpu"]["reason"] == "Requires: [GPUs>=1 (found 0)]"
    assert (out / "junit.xml").exists()
    journal = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sum("outcome" in e for e in journal) == 6 and sum("metric" in e for e in journal) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["capabilities"]["demo"] == {"passed": 2, "skipped": 4}
    result.stdout.fnmatch_lines(["*dsconform conformance summary*", "demo*2*0*4*",
                                 "skipped 4, by reason:"])


def test_collect_only_leaves_the_last_results_alone(run, pytester, tmp_path):
    """`pytest --co` runs nothing: the last run's results stay as they were."""
    run("--profile", str(profile_file(tmp_path, 0)))
    out = pytester.path / "results"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run("--profile", str(profile_file(tmp_path, 0)), "--collect-only")
    result.stdout.fnmatch_lines(["*results: not written (--collect-only)*"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    empty = pytester.path / "never"
    result = pytester.runpytest("-p", "fixtures.plugin", "--results", str(empty), "--co")
    result.stdout.fnmatch_lines(["*results: not written (--collect-only)*"])
    assert not empty.exists()


@pytest.mark.parametrize("args, message", [
    (["--profile", "no-such-profile"], "*--profile no-such-profile: no such shipped profile*"),
    (["--scratch", "/definitely/missing"], "*--scratch /definitely/missing: no such directory*"),
    (["--results", "/proc/cannot/create"], "*--results /proc/cannot/create: cannot create*"),
])
def test_bad_options_are_usage_errors(run, args, message):
    result = run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_a_profile_from_the_environment_is_named_as_such(run, monkeypatch):
    monkeypatch.setenv("DSCONFORM_PROFILE", "no-such-profile")
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*DSCONFORM_PROFILE=no-such-profile: no such shipped profile*"])
    result = run("--profile=no-such-profile")  # typed: named as typed
    result.stderr.fnmatch_lines(["*--profile no-such-profile: no such shipped profile*"])


def test_malformed_profile_names_file_and_field(run, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[profile]\nname = "b"\n[gpus]\ncount = 2\nmodle = "H200"\n')
    result = run("--profile", str(bad))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{bad}: gpus.modle: unknown key*"])


def test_unwritable_scratch_is_usage_error(run):
    # /proc is a directory nobody can create files in, root included (CI runs as root): the
    # refusal names the kind of file system, not the ENOENT a create there answers.
    result = run("--scratch", "/proc")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--scratch /proc: not a directory on a disk: it is on the "
                                 "kernel's proc file system*"])
    assert "No such file" not in result.stderr.str()


def test_an_interrupted_run_says_how_far_it_got(tmp_path):
    """SIGINT (Ctrl-C, or a time limit's `timeout -s INT`) still writes the results, and the
    summary says the run was interrupted and how many of the selected tests ran; also for a run
    started with SIGINT ignored, as a shell starts a background job."""
    import signal

    (tmp_path / "test_stop.py").write_text(
        "import time\ndef test_a(): pass\ndef test_b(): time.sleep(60)\ndef test_c(): pass\n")
    out = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "test_stop.py", "-p", "fixtures.plugin", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), "--results", str(out), "-q"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while '"test_stop.py::test_a"' not in _read(out / "records.jsonl"):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    time.sleep(0.5)  # test_b is running
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    summary = json.loads((out / "summary.json").read_text())
    said = ("the run was interrupted after 1 of 3 selected tests (Ctrl-C, or SIGINT from a time "
            "limit such as nightly-node.sh's DSCONFORM_TIME_S): the rest did not run, so this "
            "run does not accept the node")
    assert summary["exitstatus"] == 2 and said in summary["notices"]
    assert f"NOTE: {said}" in (out / "summary.txt").read_text()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_plugin_overhead_beyond_importing_deepspeed():
    """Collection and session start of the whole suite cost < 3 s beyond importing DeepSpeed."""
    def wall(cmd):
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)
            best = min(best, time.perf_counter() - t)
        return best
    # Baseline: the same pytest collection without our plugin, after importing DeepSpeed.
    base = wall([sys.executable, "-c", "import deepspeed, pytest; pytest.main(['--collect-only', "
                 "'-q', '-p', 'no:cacheprovider', '--noconftest', '-o', 'addopts=', 'suites'])"])
    full = wall([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                 "no:cacheprovider", "suites", "--results", ""])
    overhead = full - base
    print(f"plugin overhead: {overhead:.2f} s (pytest --collect-only {full:.2f} s, "
          f"import baseline {base:.2f} s)")
    assert overhead < 3.0, f"plugin overhead {overhead:.2f} s, limit 3 s"


LIMITS = '''
def test_floor_missed(metrics):
    """A floor MUST be met."""
    metrics.record_rate("copy", [1.0, 1.1, 0.9], amount=1e9, unit="GB/s", scale=1e9, floor=5.0,
                        size=1)
    metrics.record("other", [3.0, 3.0, 3.0], unit="s", better="lower", limit=1.0)

def test_floor_met(metrics):
    metrics.record_rate("copy", [0.1, 0.1, 0.1], amount=1e9, unit="GB/s", scale=1e9, floor=5.0)
'''


def test_recorder_limits_fail_the_test_after_recording_everything(pytester, tmp_path):
    """No suite can record a floor and forget to assert it: the plugin fails the test."""
    pytester.makepyfile(test_limits=LIMITS)
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile",
                                str(profile_file(tmp_path, 0)), "--results",
                                str(pytester.path / "res"))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*recorded beyond its limit: copy = 1 GB/s (median of 3 rounds: 1, 0.9091, 1.111) is "
        "below its floor 5 GB/s ?size=1, amount=1000000000.0?; other = 3 s*ceiling 1 s*"])
    doc = json.loads((pytester.path / "res" / "benchmarks.json").read_text())
    assert len(doc["benchmarks"]) == 3  # the failing values are recorded too


def test_a_killed_run_does_not_leave_the_previous_summary_for_aggregate(tmp_path):
    """A run reusing a results folder sets the last run's results aside when it starts: killed
    (SIGKILL, no results written) it leaves only its journal, and `dsconform aggregate` fails
    the node as unfinished instead of reading last night's passing summary as this run's."""
    import signal

    from dsconform.results import aggregate

    out = tmp_path / "results"
    (tmp_path / "test_ok.py").write_text("def test_a(): pass\n")
    (tmp_path / "test_killed.py").write_text(
        "import os, signal\ndef test_a(): pass\n"
        "def test_b(): os.kill(os.getpid(), signal.SIGKILL)\n")

    def run(name: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", name, "-p", "fixtures.plugin", "-p",
             "no:cacheprovider", "--rootdir", str(tmp_path), "--results", str(out), "-q"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=120)

    assert run("test_ok.py").returncode == 0
    passed = (out / "summary.json").read_text()
    killed = run("test_killed.py")
    assert killed.returncode == -signal.SIGKILL, killed.stdout
    assert not (out / "summary.json").exists() and not (out / "benchmarks.json").exists()
    assert (out / "summary.previous.json").read_text() == passed  # set aside, not lost
    report = aggregate.analyse(aggregate.collect([out]))
    [node] = report.failed_nodes
    assert "the run did not finish: no summary.json" in " ".join(node.problems), node.problems


BUILDS_THEN_MEASURE = '''
import time

import pytest
from dsconform.plugin.runstate import run_state

ORDER = []


class SlowBuilds:
    """Stands in for a cold run's op builds (dsconform.ops.prebuild.ParallelBuilds)."""

    def wait_all(self, timeout_s=3600):
        time.sleep(0.5)
        ORDER.append("builds ended")
        return {}

    def close(self):
        pass

    def timings(self):
        return {"order": [], "cores": 1, "cached": [], "builds": [], "build_seconds": {}}


@pytest.fixture(autouse=True, scope="session")
def builds(request):
    run_state(request.config).op_builds = SlowBuilds()


def test_measures(metrics):
    ORDER.append("measured")
    metrics.record("demo.value", 1.0, unit="x", better="higher")


def test_after():
    assert ORDER == ["builds ended", "measured"]
'''


def test_a_measurement_waits_for_the_op_builds_to_end(pytester):
    """A test that measures does not share the node with an op build (a cold cache): the
    metrics fixture waits for every build to end first."""
    pytester.makepyfile(test_builds=BUILDS_THEN_MEASURE)
    result = pytester.runpytest("-p", "fixtures.plugin", "--results",
                                str(pytester.path / "res"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
