"""Ops: every DeepSpeed op the profile promises MUST be reported compatible by ds_report, MUST
build and load, and a minimal real call MUST agree with a reference.

"Compatible" in ds_report is a probe, not proof: on the reference 2xH200 node every op printed
[OKAY] while every JIT build failed (TORCH_CUDA_ARCH_LIST=9.0a). So each promised op is built
(once; the cache under ~/.cache/dsconform survives runs), loaded, and called: fused_adam and
cpu_adam one-to-five steps against torch's Adam, async_io a write and read compared byte for byte,
gds a handle (and I/O where CUDA exists). A failure names the op, the cause and the fix.
Ops the profile does not promise are reported (ds_report's view, in ds_report.json under
--results) and never fail the run.
Upstream: https://www.deepspeed.ai/tutorials/advanced-install/ (ops, JIT builds, ds_report).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from dsconform.suite import (
    OpCrashed,
    OpUnavailableText,
    checks_for_run,
    parse_ds_report,
    run_ds_report,
    run_state,
    versions,
)

CAPABILITY = "ops"
pytestmark = pytest.mark.anynode  # ops are built for this node's accelerator: `-m gpu` on GPUs


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "promised_op" in metafunc.fixturenames:
        prof = run_state(metafunc.config).profile
        params = [pytest.param(op, id=op) for op in prof.ops] or [pytest.param(
            None, id="none", marks=pytest.mark.skip(
                reason=f"profile {prof.name} promises no deepspeed.ops"))]
        metafunc.parametrize("promised_op", params)


@pytest.fixture(scope="module")
def op_checks(run):
    """Every promised op's check, each in its own child process, started together as their
    parallel builds (dsconform.ops.prebuild) end: compute ops at once, I/O ops one at a time
    (dsconform.ops.checks.OpChecks). Their scratch is under --scratch. In a run with a background
    cell batch the plugin started them after collection (run.op_checks)."""
    if run.op_checks is not None:
        yield run.op_checks
        return
    root = Path(tempfile.mkdtemp(prefix="ops-", dir=run.scratch))
    checks = checks_for_run(run.profile.ops, run.node.accelerator, run.op_builds, root)
    yield checks
    checks.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def report(run, op_checks) -> dict:
    """ds_report, run once and parsed; also written to --results/ds_report.json. (The op checks
    whose builds have ended start first, so they run while ds_report does; in a run with a
    background cell batch, both started after collection.)"""
    text = run.ds_report.result() if run.ds_report is not None else run_ds_report()
    parsed = parse_ds_report(text)
    results = run.results
    if results is not None:
        (results / "ds_report.json").write_text(json.dumps(parsed, indent=2, sort_keys=True))
    return parsed


def test_ds_report_describes_this_install(report, node):
    """OPS-REPORT-1: ds_report MUST run, list ops, and name the DeepSpeed and torch that are
    installed."""
    assert report["ops"], "ds_report listed no ops"
    env = report["env"]
    assert env.get("deepspeed_version", "").startswith(node.deepspeed_version or "?"), \
        (f"expected DeepSpeed {node.deepspeed_version}, "
         f"ds_report says {env.get('deepspeed_version')}")
    # The package metadata may omit the local build tag ("2.11.0" vs torch's "2.11.0+cu130").
    found = versions.public(str(env.get("torch_version")))
    assert found is not None and found == versions.public(node.torch_version), \
        f"expected torch {node.torch_version}, ds_report says {env.get('torch_version')}"


def test_unpromised_ops_are_reported(report, profile):
    """OPS-REPORT-2: Ops the profile does not promise MUST be reported with ds_report's status,
    never failed."""
    rows = [f"{name}: installed={'yes' if op['installed'] else 'no'}, "
            f"compatible={'yes' if op['compatible'] else 'no'}"
            + (f" ({'; '.join(op['warnings'])})" if op["warnings"] else "")
            for name, op in sorted(report["ops"].items()) if name not in profile.ops]
    print(f"ops not promised by profile {profile.name} (not built):\n  " + "\n  ".join(rows))


def test_promised_op(promised_op, report, op_checks, node, metrics, profile, run):
    """OPS-LOAD-1: A promised op MUST be ds_report-compatible, build, load, and compute like its
    reference."""
    problems = []
    status = report["ops"].get(promised_op)
    if status is None:
        problems.append(f"ds_report does not list {promised_op} on the {node.accelerator} "
                        "accelerator")
    elif not status["compatible"]:
        problems.append(f"ds_report: {promised_op} not compatible: "
                        f"{'; '.join(status['warnings']) or 'no reason printed'}")
    # The run started every promised op's build in parallel (dsconform.ops.prebuild): wait for this
    # one. A failed build is reported from its own result, with the diagnosis.
    build = run.op_builds.wait(promised_op) if run.op_builds is not None else None
    result = None
    if build is not None and not build["loaded"]:
        problems.append(build["failure"] or f"op {promised_op} did not build")
    else:
        try:  # in a child process: a native crash fails this test, not the whole run
            result = op_checks.get(promised_op).result()
        except (OpUnavailableText, OpCrashed) as e:
            problems.append(str(e))
    if result is None:  # outside the except: no "during handling" chain in the report
        pytest.fail(f"profile {profile.name} promises op {promised_op}, which does not load: "
                    + "\n".join(problems), pytrace=False)
    if build is not None:  # the build (or warm load) as it happened in the parallel build
        metrics.record(f"{promised_op}.build_seconds", build["build_seconds"], unit="s",
                       better="lower", built_now=build["built_now"], builder=build["builder"],
                       jobs=build["jobs"])
    metrics.record(f"{promised_op}.load_seconds", result["build_seconds"], unit="s",
                   better="lower", built_now=result["built_now"], builder=result["builder"])
    if "max_abs_diff" in result:  # checked against rtol/atol inside check_op; recorded for drift
        metrics.record(f"{promised_op}.max_abs_diff", result["max_abs_diff"], unit="abs",
                       better="lower", steps=result["steps"], rtol=result["rtol"],
                       atol=result["atol"])
    # The I/O ops' check moves one buffer once: its GB/s is one round, below what a performance
    # value needs (3), and in a run with a background batch it is taken beside the batch. The
    # DeepNVMe suite measures throughput (3 rounds, floors); only the bytes are checked here.
    assert not problems, "\n".join(problems)
