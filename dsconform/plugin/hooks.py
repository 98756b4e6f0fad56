"""pytest glue: gating, report header, collection (tiers, known issues, op builds, standby
ranks, the cell batch) and the hooks around each test; the logic lives in ``dsconform``. The
options come from ``dsconform.plugin.options``; the checkout's ``fixtures/plugin.py`` loads this
module (docs/architecture.md#how-a-run-flows)."""

from __future__ import annotations

import functools
import gc
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dsconform import __version__, settings
from dsconform.base import cpu_info, versions
from dsconform.gate import known_issues
from dsconform.gate import requires as gating
from dsconform.harness import output as rank_output
from dsconform.harness import timeline, zygote
from dsconform.node import nccl_env
from dsconform.plugin import refusal
from dsconform.plugin.console import Console
from dsconform.plugin.hypothesis_profiles import register as _register_hypothesis_profiles
from dsconform.plugin.items import is_xdist_worker, ops_to_build, order_key, selects_ops_suite
from dsconform.plugin.keys import BROKEN_PROMISE, COVERED_BY, ITEM_CAPABILITY, RECORDER
from dsconform.plugin.options import add_options
from dsconform.plugin.recorder import Recorder, capability_from_nodeid, case_facts
from dsconform.plugin.runstate import STATE, RunState, run_state
from dsconform.profile.select import (
    detected_warning,
    is_detected,
    rendezvous_nodes,
    run_kind,
    select_profile,
    selects_gpu_tests,
)
from dsconform.results.records import CASE_PROPERTY

_register_hypothesis_profiles()

# The refused verdict, around the whole run.
pytest_plugins = ["dsconform.plugin.refusal"]


#: Where a pytest run's rank output goes (dsconform.harness.output): --results/ranks.log.
RANK_LOG = pytest.StashKey[object]()


def pytest_addoption(parser: pytest.Parser) -> None:
    # The entry point registered them already, unless PYTEST_DISABLE_PLUGIN_AUTOLOAD (then only
    # --opt=VALUE forms parse a path outside the checkout); add_options is idempotent.
    add_options(parser)


@pytest.hookimpl(tryfirst=True)  # before junitxml's configure reads xmlpath
def pytest_configure(config: pytest.Config) -> None:
    timeline.mark("pytest configures")
    for name, text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    # Before any check can refuse the run: the last run's verdict must not outlive a refusal
    # (a refusal's own verdict: dsconform.plugin.refusal's pytest_cmdline_main).
    refusal.begin(config, started=started, is_worker=is_xdist_worker(config))
    # SIGINT stops a run and still writes its results, but a shell starts a background job
    # (`cmd &`) with SIGINT ignored and Python then installs no handler: take it back.
    if (not is_xdist_worker(config) and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # --collect-only (or --help, --fixtures, ...) runs no test: writing results would replace
    # the last real run's with an empty one.
    runs = refusal.runs_tests(config)
    results = refusal.check_results(config.getoption("--results")) if runs else None
    refusal.results_ready(config, results)
    scratch, scratch_is_temp = refusal.check_scratch(config.getoption("--scratch"))
    if results is not None and not is_xdist_worker(config) and not config.option.xmlpath:
        config.option.xmlpath = str(results / "junit.xml")
    # Every rank's stdout and stderr, by test (dsconform.harness.output): the controller starts
    # the file, xdist workers append to it.
    worker = getattr(config, "workerinput", {}).get("workerid", "")
    log = results / "ranks.log" if results is not None else None
    config.stash[RANK_LOG] = rank_output.configure(log, worker=worker, truncate=not worker)
    if not config.option.collectonly:
        # DeepSpeed asks py-cpuinfo about the CPU (a second each time) in every process that
        # loads an op or builds CPU Adam: asked once, beside the start-up, and shared.
        cpu_info.install()
        cpu_info.start_asking()
        with rank_output.fds_to_log():
            # Before any rank: every rank process shares this tracker, and what it says at the
            # process's exit (semaphores a killed rank left) goes to the rank log.
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
            if _gpu_run(config) and any(Path("/dev").glob("nvidia[0-9]*")):
                # Its imports (torch, inductor) overlap this process's own, which finding
                # the node and the profile begin with.
                zygote.start_ahead()
    try:
        # The op cache of this environment (docs/findings.md#op-builds), rid of a killed build's
        # lock (StaleBuildLock where it cannot be proven stale) and of killed inductor compiles.
        from dsconform.base.buildlock import clear_stale
        from dsconform.ops.cache import ensure_extensions_dir, sweep_inductor_cache
        notices = clear_stale(ensure_extensions_dir()) + sweep_inductor_cache()
        selection = select_profile(config.getoption("--profile"), named=_profile_named(config))
        timeline.mark("node and profile found")
        soak = _soak_minutes(config, selection.node, runs)
    except (ValueError, RuntimeError) as e:  # ProfileError, StaleBuildLock: name what to fix
        if scratch_is_temp:
            shutil.rmtree(scratch, ignore_errors=True)
        raise refusal.usage(str(e).replace("\n", "\n  ")) from None
    state = RunState(
        selection=selection, scratch=scratch, scratch_is_temp=scratch_is_temp, results=results,
        started=started, multinode=rendezvous_nodes() > 1, notices=notices, soak_minutes=soak,
        kind=run_kind(config.option.markexpr, selection.node) if runs else None)
    state.notices.append(versions.torch_note(selection.node.torch_version))
    if is_detected(selection.profile):
        state.notices.append(detected_warning())
    if selection.node.unusable_gpus():
        state.notices.append(f"GPUs not usable: {selection.node.unusable_gpus()}")
    config.stash[STATE] = state
    if _gpu_run(config) and selection.node.is_gpu_node and _runs_ops_suite(config):
        from dsconform.ops.prebuild import ParallelBuilds, longest_first
        state.op_builds = ParallelBuilds.start(longest_first(selection.profile.ops),
                                               skip_cached=True)
    if selects_gpu_tests(config.option.markexpr) and not config.getoption("--nightly"):
        from dsconform.plugin.hypothesis_profiles import use_for_acceptance
        use_for_acceptance(config)
    if selection.node.is_gpu_node and not config.option.collectonly:
        from dsconform.node.neighbours import NeighbourWatch
        state.neighbours = NeighbourWatch.on_this_node().start()
    if not is_xdist_worker(config):
        config.pluginmanager.register(Recorder(state), "dsconform-recorder")
    console = Console(config)
    config.pluginmanager.register(console, "dsconform-console")
    state.say = console.say
    timeline.mark("configured")


def _soak_minutes(config: pytest.Config, node: Any, runs: bool) -> float | None:
    """--soak MINUTES, checked: a positive number, and a node with GPUs when tests run (a
    burn-in that finds no GPU is refused, never a pass or "no tests ran"). Raises ValueError
    (a usage error naming the option)."""
    minutes = config.getoption("--soak", None)
    if minutes is None:
        return None
    if not minutes > 0:
        raise ValueError(f"--soak {minutes:g}: MINUTES must be a number above 0")
    if runs and not node.is_gpu_node:
        raise ValueError(f"--soak {minutes:g}: a burn-in runs on GPUs and this node has none "
                            "(NVML, /proc/driver/nvidia and the PCI bus show no NVIDIA GPU)")
    return minutes


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: Any) -> Any:
    """A test marked ``soak`` exists only with --soak: without it no item is made, so the
    collected ids (and their count) are those of a suite without the soak."""
    marks = getattr(obj, "pytestmark", None) if callable(obj) else None
    if marks and any(getattr(m, "name", "") == "soak" for m in marks) \
            and collector.config.getoption("--soak", None) is None:
        return []
    return None


def _profile_named(config: pytest.Config) -> str:
    """How the user gave the profile, for its errors: DSCONFORM_PROFILE when it came from there,
    not a --profile the user never typed."""
    spec = config.getoption("--profile")
    typed = any(str(a) == "--profile" or str(a).startswith("--profile=")
                for a in config.invocation_params.args)
    if typed or settings.given("DSCONFORM_PROFILE") != spec:
        return f"--profile {spec}"
    return f"DSCONFORM_PROFILE={spec}"


_MARKERS = {
    "gpu": "needs a GPU (implies requires(min_gpus=1))",
    "multigpu": "needs several GPUs of one node (implies requires(min_gpus=2))",
    "nvme": "needs an NVMe path from the profile (implies requires(nvme=True))",
    "multinode": "needs a multi-node rendezvous (torchrun/Slurm variables)",
    "anynode": "runs on this node's own accelerator: on a GPU node it is also a `gpu` test",
    "slow": "long-running: minutes, not seconds; nightly tier",
    "benchmark": "measures performance against a floor",
    "requires(**conditions)": "dsconform gate: min_gpus, bf16, fp16, op, nvme, nccl, deepspeed",
    "one_gpu_tier": "a one-rank cell of the nightly matrix that joins the acceptance tier on a "
                    "node with one GPU (it covers what the two-rank cells cover elsewhere)",
    "covered_on_one_gpu": "a two-rank acceptance cell whose check one-rank cells cover on a node "
                          "with one GPU: left out there, not skipped",
    "promised_ops_only": "joins the acceptance tier only where the profile promises the ops it "
                         "loads (requires(op=...)); the nightly tier runs it wherever they are "
                         "compatible",
    "run_first": "runs before every other test (the hardware gate before the run)",
    "run_last": "runs after every other test (the hardware gate after the run)",
    "soak": "the burn-in: collected only with --soak MINUTES, runs after every other test but "
            "the hardware gate's end",
}


def pytest_unconfigure(config: pytest.Config) -> None:
    sink, state = config.stash.get(RANK_LOG, None), config.stash.get(STATE, None)
    try:
        if state is not None:
            if state.neighbours is not None:
                state.neighbours.stop()
            if state.op_checks is not None:
                state.op_checks.close()
                shutil.rmtree(state.op_checks.scratch_root, ignore_errors=True)
            if state.op_builds is not None:
                state.op_builds.close()
            if "dsconform.plugin.batch" in sys.modules:
                sys.modules["dsconform.plugin.batch"].stop(config)
            if "dsconform.harness.api" in sys.modules:  # only if some test started ranks
                sys.modules["dsconform.harness.api"].shutdown_pools()
            zygote.stop()  # started at load even where no test started ranks
            if state.scratch_is_temp:
                shutil.rmtree(state.scratch, ignore_errors=True)
    finally:
        if sink is not None:
            rank_output.release(sink)
    # The process ends with this run (not a pytester run inside another, not an xdist worker):
    # pytest's end walks every object torch and DeepSpeed made, none of them garbage now:
    # frozen, they are skipped (docs/performance.md#the-end-of-a-run).
    if not is_xdist_worker(config) and \
            tuple(map(str, config.invocation_params.args)) == tuple(sys.argv[1:]):
        gc.freeze()


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = run_state(config)
    n, p = state.node, state.profile
    gpus = (f"{n.gpus_present}x {n.present_model or 'NVIDIA GPU'} present "
            f"({n.hardware.source}), {n.gpu_count} usable by torch") if n.is_gpu_node else "no GPUs"
    not_written = "not written (--collect-only)" if config.option.collectonly else "not written"
    lines = [
        f"dsconform {__version__}: node {n.hostname}: {gpus}, {n.cpu_cores} cores",
        f"dsconform versions: deepspeed {n.deepspeed_version}, torch {n.torch_version}, "
        f"CUDA {n.cuda_version or '-'}, driver {n.driver_version or '-'}, "
        f"NCCL {n.nccl_version or '-'}, python {n.python}",
        f"dsconform {nccl_env.header_line(nccl_env.nccl_settings())}",
        f"dsconform profile: {p.name} ({state.selection.how})",
        f"dsconform run: {state.kind.description}" if state.kind else "",
        f"dsconform scratch: {state.scratch}{' (temporary)' if state.scratch_is_temp else ''}; "
        f"results: {state.results or not_written}",
    ]
    lines += [f"dsconform NOTE: {notice}" for notice in state.notices]
    if state.kind is not None and state.kind.failure:  # said once, before any test runs
        lines.append(f"dsconform: {state.kind.failure}")
    return [ln for ln in lines if ln]


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `anynode` tests join `-m gpu` on GPU nodes
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    state = run_state(config)
    # GPUs present in hardware, not only the ones torch can use: on a node whose torch lost its
    # GPUs the promise tests must still run under -m gpu, and fail.
    on_gpu_node = state.node.is_gpu_node
    for item in items:
        # The suite module's CAPABILITY, else one derived from its file name.
        item.stash[ITEM_CAPABILITY] = getattr(getattr(item, "module", None), "CAPABILITY", None) \
            or capability_from_nodeid(item.nodeid)
        if on_gpu_node and item.get_closest_marker("anynode"):
            item.add_marker(pytest.mark.gpu)
        _mark_known_issues(item, state)
    _select_tier(config, items)
    # The profile's promises first (a broken one is known at once); with a cell batch, the rest
    # in its phases (dsconform.plugin.batch.phases).
    from dsconform.plugin import batch
    phase = batch.phases(items) if batch.enabled(state) else {}
    items.sort(key=lambda it: order_key(it, phase.get(id(it), 0)))


def _select_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The acceptance tier leaves out `slow` tests unless -m names `slow` or --nightly asks for
    them; on a node with one GPU it takes the cells marked `one_gpu_tier` in place of those
    marked `covered_on_one_gpu`; a test marked `promised_ops_only` joins it only where the
    profile promises its ops (docs/suites.md). The summary's NOTE names what the nightly tier
    adds."""
    markexpr = config.option.markexpr or ""
    if config.getoption("--nightly") or not markexpr or re.search(r"\bslow\b", markexpr):
        return
    state = run_state(config)
    one_gpu = state.node.gpu_count == 1

    def unpromised(it: pytest.Item) -> list[str]:
        if it.get_closest_marker("promised_ops_only") is None:
            return []
        return [op for op in gating.item_ops(it) if op not in state.profile.ops]

    def left_out(it: pytest.Item) -> bool:
        if unpromised(it):
            return True
        if one_gpu and it.get_closest_marker("gpu"):
            if it.get_closest_marker("one_gpu_tier"):
                return False
            if it.get_closest_marker("covered_on_one_gpu"):
                return True
        return it.get_closest_marker("slow") is not None

    out = [it for it in items if left_out(it)]
    if one_gpu:
        replaced = sum(1 for it in out if it.get_closest_marker("covered_on_one_gpu")
                       and not it.get_closest_marker("slow"))
        joined = sum(1 for it in items if it.get_closest_marker("one_gpu_tier")
                     and it.get_closest_marker("gpu"))
        if replaced or joined:
            state.notices.append(
                f"one GPU: {joined} one-rank cells join the acceptance tier in place of "
                f"{replaced} two-rank cells whose checks they cover")
    if nightly_only := {op for it in out for op in unpromised(it)}:
        names = ", ".join(sorted(nightly_only))
        tests = sorted({it.originalname for it in out if unpromised(it)})
        state.notices.append(
            f"profile {state.profile.name} does not promise op {names}: the acceptance tier "
            f"leaves out {', '.join(tests)}; --nightly runs it where the op is compatible")
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [it for it in items if not left_out(it)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the ops' builds (dsconform.ops.prebuild), the standby ranks and the cell batch once
    the selection is known; what this prints goes to the rank log, not between pytest's lines.
    Under xdist every worker starts the builds; torch's build lock makes the later ones wait."""
    state = run_state(session.config)
    if session.config.option.collectonly:
        return
    cpu_info.share()  # ranks and builds started from here on inherit py-cpuinfo's answer
    timeline.mark("collected")
    took: list[tuple[str, float]] = []
    t0 = time.monotonic()

    def step(what: str) -> None:
        nonlocal t0
        took.append((what, time.monotonic() - t0))
        t0 = time.monotonic()

    with rank_output.capture("(collection)"):
        _start_standby_ranks(session, state)
        step("standby ranks")
        from dsconform.plugin import batch
        cells = batch.select(session, state) if batch.enabled(state) else []
        step("the batch's cells")
        if ops := ops_to_build(session.items, state):
            from dsconform.ops.prebuild import ParallelBuilds, longest_first
            if state.op_builds is None:
                state.op_builds = ParallelBuilds.start(longest_first(ops), skip_cached=True)
            else:  # the promised ops' builds started as the run configured
                state.op_builds.add(longest_first(ops))
        if state.op_builds is not None and state.op_builds.on_progress is None:
            # a wait for any of this run's builds says how it goes (those started by another
            # plugin's collection_finish too)
            state.op_builds.on_progress = session.config.pluginmanager.get_plugin(
                "dsconform-console").progress
        step("op builds")
        started = 0
        if batch.enabled(state):  # the ops suite's checks start beside it
            _start_ops_suite(session, state)
            started = batch.start(session, state, cells)
        step("cell batch")
    timeline.mark("tests start")
    # Where the time between collection and the first test goes (docs/performance.md).
    rank_output.record("(collection)", "controller", "collection's end: " + ", ".join(
        f"{what} {secs:.2f} s" for what, secs in took))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if started and reporter is not None:  # the tests that wait for it show nothing meanwhile
        reporter.write_line(
            f"cell batch: {started} cells started in the background "
            f"({batch.lane_count(state)} lanes per world size); the tests that measure wait for "
            "it to end")


def _gpu_run(config: pytest.Config) -> bool:
    """Whether this process runs the GPU tests (-m gpu): the fork server starts as it configures."""
    return (not config.option.collectonly and not is_xdist_worker(config)
            and selects_gpu_tests(config.option.markexpr))


def _runs_ops_suite(config: pytest.Config) -> bool:
    """Whether the arguments name the ops suite (its file or a folder above it), no -k or
    --deselect can leave it out and this process collects (no xdist): its promised ops are then
    built from the start, not after collection (docs/performance.md#op-builds)."""
    if config.option.keyword or config.getoption("deselect", None) or \
            getattr(config.option, "numprocesses", None):  # xdist: its workers collect
        return False
    suite = (config.rootpath / "suites" / "test_ops.py").resolve()
    return any((config.invocation_params.dir / arg.split("::")[0]).resolve()
               in (suite, *suite.parents) for arg in config.args)


def _start_standby_ranks(session: pytest.Session, state: RunState) -> None:
    """On a GPU node whose selection has GPU tests, keep the cuda standby ranks started (one
    GPU, and two when a multi-GPU test is selected; warmed and never-warmed) and, with a cell
    batch, its lanes: their start-up overlaps the op builds and the promise tests."""
    from dsconform.harness import api as dist
    gpu_items = [it for it in session.items if it.get_closest_marker("gpu")]
    if not gpu_items or state.node.gpu_count < 1 or dist.external_rendezvous() \
            or not dist.spares_enabled("cuda"):
        return
    sizes = [1, 2] if state.node.gpu_count >= 2 and any(
        it.get_closest_marker("multigpu") for it in gpu_items) else [1]
    dist.start_spares(sizes, "cuda")
    dist.start_spares(sizes, "cuda", fresh=True)
    from dsconform.plugin import batch
    if batch.enabled(state) and any(batch.has_plan(it) for it in gpu_items):
        from dsconform.harness.lanes import start_lanes
        start_lanes(sizes, "cuda")


def _start_ops_suite(session: pytest.Session, state: RunState) -> None:
    """With a background batch, the ops suite's child processes (ds_report, each promised op's
    check) start now and run beside the tests that do not measure: the ops tests, which come
    with the measuring ones, then only read their results."""
    if not selects_ops_suite(session.items):
        return
    from concurrent.futures import ThreadPoolExecutor

    from dsconform.node.dsreport import run_ds_report
    from dsconform.ops.checks import checks_for_run
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsconform-ds-report")
    state.ds_report = pool.submit(run_ds_report)
    pool.shutdown(wait=False)
    state.op_checks = checks_for_run(state.profile.ops, state.node.accelerator, state.op_builds,
                                     tempfile.mkdtemp(prefix="ops-", dir=state.scratch))
    state.op_checks.start_all()


def _mark_known_issues(item: pytest.Item, state: RunState) -> None:
    """A case covered by a known upstream issue on this DeepSpeed version becomes a strict xfail
    that only the issue's own failure satisfies (pytest_runtest_call turns it into a
    KnownIssueFailure; a crash, a hang or another assertion still fails)."""
    case = known_issues.case_name(Path(str(item.fspath)).name, item.name)
    issues = known_issues.issues_for(case, state.node.deepspeed_version)
    for ki in issues:
        if not ki.intermittent:  # a race's case may pass: its failure alone becomes an xfail
            item.add_marker(pytest.mark.xfail(reason=ki.reason, strict=True,
                                              raises=known_issues.KnownIssueFailure))
        state.known_issue_cases[item.nodeid] = ki.id
    if issues:
        item.stash[COVERED_BY] = issues


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = run_state(item.config)
    verdict = state.verdict(item)
    if verdict is not None and verdict.broken_promises:
        # Fail in the call phase so it counts as FAILED (a broken promise), not as an ERROR of
        # the test's setup; pytest_pyfunc_call below raises it instead of running the test.
        item.stash[BROKEN_PROMISE] = verdict.fail_reason
    elif verdict is not None and not verdict.ok:
        raise pytest.skip.Exception(verdict.skip_reason, _use_item_location=True)
    elif state.op_builds is not None:
        # Else a rank waits for the build's lock or builds the op itself, unseen by the scheduler
        # (docs/performance.md#what-dominates-cold-and-warm-1xh200-pytest-suites--m-gpu-auto).
        for op in gating.item_ops(item):
            state.op_builds.wait(op)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if (reason := pyfuncitem.stash.get(BROKEN_PROMISE, None)) is not None:
        pytest.fail(reason, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """The outcome's facts travel with the report, where the controller can read them (what a
    failing report shows: dsconform.plugin.console)."""
    report = yield
    if report.when != "teardown":
        known = item.config.stash[STATE].known_issue_cases.get(item.nodeid, "")
        report.user_properties.append((CASE_PROPERTY, case_facts(item, known)))
    return report


def _no_shrinking(item: pytest.Item):
    """A property test on a case a known issue covers: its first failing example is the
    issue's (or a real failure, named as such), so hypothesis does not shrink it (each step
    runs an example on new ranks). Returns what restores the test's settings."""
    test = getattr(item, "obj", None)
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    if current is None:
        return None
    from hypothesis import Phase, settings

    phases = tuple(ph for ph in current.phases if ph is not Phase.shrink)
    test._hypothesis_internal_use_settings = settings(current, phases=phases)
    return functools.partial(setattr, test, "_hypothesis_internal_use_settings", current)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The recorder's limits are enforced here, once the test body returned: every value is
    recorded first, then the test fails naming each one beyond its floor or ceiling."""
    restore = _no_shrinking(item) if item.stash.get(COVERED_BY, None) else None
    try:
        result = yield
    except (AssertionError, BaseExceptionGroup) as exc:  # a group: hypothesis' flaky report
        issues = item.stash.get(COVERED_BY, None)
        if issues:
            failure = known_issues.expected_failure(issues, exc)
            if getattr(failure, "issue_id", None):  # of several issues, the one that failed
                run_state(item.config).known_issue_cases[item.nodeid] = failure.issue_id
                # Its message holds the check's whole; no report shows the traceback pytest
                # would format anyway (docs/performance.md, "What dominates").
                __tracebackhide__ = True
                raise failure from None
            raise failure from exc
        raise
    finally:
        if restore is not None:
            restore()
    recorder = item.stash.get(RECORDER, None)
    if recorder is not None and (found := recorder.violations()):
        pytest.fail("recorded beyond its limit: " + "; ".join(found), pytrace=False)
    return result
