"""Op builds at run start: results per op, failures carried to the op's test, every build at
once with the cores, the awaited one first in priority, longest first."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from dsconform.ops import prebuild as opbuild
from dsconform.ops.prebuild import ParallelBuilds


def test_parallel_builds_report_each_op():
    builds = ParallelBuilds.start(["cpu_adam", "no_such_op"], cores=2)
    try:
        ok = builds.wait("cpu_adam")  # every build may use every core; nice orders them
        assert ok["loaded"] and ok["failure"] is None and ok["build_seconds"] > 0
        assert ok["jobs"] == 2 and ok["wall_seconds"] >= ok["build_seconds"]
        bad = builds.wait("no_such_op")
        assert not bad["loaded"]
        assert "op no_such_op" in bad["failure"] and "not provided" in bad["failure"]
        assert builds.wait("fused_adam") is None  # not started by this run
    finally:
        builds.close()


def test_a_build_that_dies_is_a_result_not_a_hang():
    builds = ParallelBuilds.start(["cpu_adam"], cores=1)
    builds.builds["cpu_adam"].proc.kill()
    res = builds.wait("cpu_adam", timeout_s=60)
    assert not res["loaded"] and "without a result" in res["failure"]


def test_a_build_that_prints_more_than_a_pipe_holds_still_finishes_unread(monkeypatch):
    """Builds run while other tests do: nobody calls wait() until the op's test. A build whose
    output fills the pipe (compiler warnings) must not stop there, holding the extension lock."""
    child = ("import json, sys\n"
             "sys.stdout.write('warning: something\\n' * 60000)\n"  # about 1.2 MB
             f"print({opbuild._MARK!r} + json.dumps({{'op': sys.argv[1], 'loaded': True, "
             "'failure': None, 'log_tail': ''}), flush=True)\n")
    monkeypatch.setattr(opbuild, "_CHILD", child)
    builds = ParallelBuilds.start(["chatty"], cores=1)
    try:
        deadline = time.monotonic() + 30
        while not builds.finished("chatty") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert builds.finished("chatty"), "the build stopped on a full output pipe"
        res = builds.wait("chatty")
        assert res["loaded"] and len(builds.builds["chatty"].output) > 1_000_000
    finally:
        builds.close()


#: A build that takes FAKE_BUILDS[op]["seconds"] and reports what it ran with: its MAX_JOBS, the
#: nice level it runs at, when it started.
FAKE = f"""
import json, os, sys, time
op, nice = sys.argv[1], int(sys.argv[2])
if nice:
    os.nice(nice)
spec = json.loads(os.environ["FAKE_BUILDS"])[op]
start = time.time()
time.sleep(spec["seconds"])
print({opbuild._MARK!r} + json.dumps({{
    "op": op, "loaded": not spec.get("fail"), "built_now": True,
    "failure": "op " + op + ": fake failure" if spec.get("fail") else None,
    "build_seconds": spec["seconds"], "max_jobs": os.environ["MAX_JOBS"],
    "niceness": os.nice(0), "t_start": start, "t_end": time.time()}}), flush=True)
"""


def _fake_command(op: str, nice: int) -> list[str]:
    return [sys.executable, "-c", FAKE, op, str(nice)]


def _run_fake(monkeypatch, specs: dict, order: list[str], cores: int):
    monkeypatch.setenv("FAKE_BUILDS", json.dumps(specs))
    events = []
    builds = ParallelBuilds.start(order, cores, command=_fake_command,
                                  on_event=lambda op, what, info: events.append((op, what)))
    try:
        results = builds.wait_all(timeout_s=60)
    finally:
        builds.close()
    return builds, results, events


def test_every_build_starts_at_once_each_nicer_than_the_one_before(monkeypatch):
    """The awaited build at nice 0, the next at 10, the rest at 19, all at once, each with every
    core: a build takes what the builds before it leave idle."""
    specs = {"aio": {"seconds": 1.5}, "adam": {"seconds": 1.0}, "utils": {"seconds": 0.3},
             "gds": {"seconds": 0.3}}
    builds, r, events = _run_fake(monkeypatch, specs, ["aio", "adam", "utils", "gds"], 8)
    assert [op for op, what in events if what == "start"] == ["aio", "adam", "utils", "gds"]
    assert sorted(op for op, what in events if what == "done") == sorted(specs)
    assert {op: r[op]["max_jobs"] for op in r} == dict.fromkeys(specs, "8")
    assert {op: r[op]["niceness"] for op in r} == {"aio": 0, "adam": 10, "utils": 19, "gds": 19}
    starts = [r[op]["t_start"] for op in specs]
    assert max(starts) - min(starts) < 1.0, "a build waited for another"
    timings = builds.timings()
    assert [b["op"] for b in timings["builds"]] == ["aio", "adam", "utils", "gds"]
    assert timings["build_seconds"] == {"aio": 1.5, "adam": 1.0, "utils": 0.3, "gds": 0.3}
    line = opbuild.summary_line(timings)
    assert line.startswith("op builds: aio ") and "adam" in line and "nice 10" in line


def test_a_build_is_reported_before_its_wait_returns(monkeypatch):
    """build-ops prints how each build ended (its "done" event) and then its last line, once
    every wait has returned: the event must have run by then, however slow the printer."""
    monkeypatch.setenv("FAKE_BUILDS", json.dumps({"a": {"seconds": 0.1, "fail": True}}))
    order = []

    def slow_printer(op, what, info):
        if what == "done":
            time.sleep(0.5)
            order.append("reported")

    builds = ParallelBuilds.start(["a"], 1, command=_fake_command, on_event=slow_printer)
    try:
        assert not builds.wait("a", timeout_s=60)["loaded"]
        order.append("returned")
    finally:
        builds.close()
    assert order == ["reported", "returned"]


def test_builds_added_later_start_once_after_the_first_in_priority(monkeypatch, tmp_path):
    """A run starts its promised ops' builds as it configures and adds the ops its selected
    tests load once collection ends: an op asked for again is not built twice, one in the
    cache is left out, the new ones follow in priority."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "c.so").write_bytes(b"")
    monkeypatch.setenv("FAKE_BUILDS", json.dumps(
        {"a": {"seconds": 0.5}, "b": {"seconds": 0.2}, "c": {"seconds": 0.1}}))
    events = []
    run = ParallelBuilds.start(["a"], 2, skip_cached=True, ext_dir=tmp_path,
                               command=_fake_command,
                               on_event=lambda op, what, info: events.append((op, what)))
    try:
        run.add(["a", "b", "c"], ext_dir=tmp_path)
        r = run.wait_all(timeout_s=30)
        assert run.order == ["a", "b"] and run.timings()["cached"] == ["c"]
        assert [op for op, what in events if what == "start"] == ["a", "b"]
        assert r["a"]["niceness"] == 0 and r["b"]["niceness"] == 10
    finally:
        run.close()


def test_a_failed_build_is_its_ops_result_and_the_summary_says_so(monkeypatch):
    specs = {"a": {"seconds": 0.5}, "b": {"seconds": 0.2, "fail": True}}
    builds, r, _ = _run_fake(monkeypatch, specs, ["a", "b"], 2)
    assert r["a"]["loaded"] and r["a"]["niceness"] == 0
    assert not r["b"]["loaded"] and "fake failure" in r["b"]["failure"]
    line = opbuild.summary_line(builds.timings())
    assert "b 0." in line and "FAILED" in line


def test_ops_in_the_cache_are_left_out_of_a_run_or_only_load(monkeypatch, tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "b.so").write_bytes(b"")
    monkeypatch.setenv("FAKE_BUILDS", json.dumps({"a": {"seconds": 1.0}, "b": {"seconds": 0.1}}))
    run = ParallelBuilds.start(["a", "b"], 2, skip_cached=True, ext_dir=tmp_path,
                               command=_fake_command)
    try:
        assert run.order == ["a"] and run.wait("b") is None and run.finished("b")
        assert run.wait("a")["loaded"]
        assert run.timings()["cached"] == ["b"]
        assert "in the cache: b" in opbuild.summary_line(run.timings())
    finally:
        run.close()
    # build-ops: a cached op is loaded beside the builds, below the awaited one
    cli = ParallelBuilds.start(["b", "a"], 2, ext_dir=tmp_path, command=_fake_command)
    try:
        r = cli.wait_all(timeout_s=30)
        assert r["b"]["t_start"] < r["a"]["t_end"], "a load waited for a busy build"
        assert r["a"]["niceness"] == 0 and r["b"]["niceness"] == 10
    finally:
        cli.close()


def test_a_build_past_its_timeout_is_killed_and_says_so(monkeypatch):
    monkeypatch.setenv("FAKE_BUILDS", json.dumps({"a": {"seconds": 30.0}}))
    run = ParallelBuilds.start(["a"], 1, command=_fake_command, share_cpu_info=False)
    try:
        t0 = time.monotonic()
        r = run.wait("a", timeout_s=0.5)
        assert time.monotonic() - t0 < 10
        assert not r["loaded"] and "did not finish within 0 s" in r["failure"]
        assert run.builds["a"].proc.returncode is not None
    finally:
        run.close()


def test_a_build_older_than_its_sources_is_not_in_the_cache(monkeypatch, tmp_path):
    """A reinstalled DeepSpeed writes its sources anew: ninja would rebuild the op in the first
    process that loads it, so the run builds it itself, seen and scheduled."""
    import os

    source = tmp_path / "src" / "b.cpp"
    source.parent.mkdir()
    source.write_text("")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "b.so").write_bytes(b"")
    (tmp_path / "b" / "build.ninja").write_text(
        f"rule compile\n  command = c++ $in\nbuild b.o: compile {source}\n"
        "build b.so: link b.o\n")
    os.utime(source, (1_000_000, 1_000_000))
    assert opbuild.is_cached("b", tmp_path)
    os.utime(source, None)  # now: newer than the build
    os.utime(tmp_path / "b" / "b.so", (2_000_000, 2_000_000))
    assert not opbuild.is_cached("b", tmp_path)
    monkeypatch.setenv("FAKE_BUILDS", json.dumps({"b": {"seconds": 0.1}}))
    run = ParallelBuilds.start(["b"], 1, skip_cached=True, ext_dir=tmp_path,
                               command=_fake_command)
    try:
        assert run.order == ["b"] and run.wait("b", timeout_s=30)["loaded"]
    finally:
        run.close()


class _Item:
    """Just enough of a collected test for ops_to_build, build_needs and the batch."""

    def __init__(self, path: str, *marks, plan=None, measures=False) -> None:
        self.fspath = path
        self.nodeid = f"{path}::t{id(self)}"
        self._marks = [m.mark for m in marks]
        self.fixturenames = ["metrics"] if measures else []
        if plan is not None:
            from dsconform.plugin.batch import batched

            def function():
                pass
            self.function = batched(plan)(function)

    def get_closest_marker(self, name):
        return next((m for m in self._marks if m.name == name), None)

    def iter_markers(self, name=None):
        return (m for m in self._marks if name is None or m.name == name)


def _run_state(gpus: int, ops: tuple[str, ...], compatible: dict[str, bool]):
    """A RunState on a fake node of ``gpus`` GPUs whose profile promises ``ops``; the ops'
    compatibility as given (the gate's probe is not run)."""
    from dsconform.plugin.runstate import RunState
    from dsconform.profile.schema import Profile
    from dsconform.profile.select import Selection
    from tests.node.test_detect import fake_node

    node = fake_node(gpus)
    profile = Profile(name="p", source="t", gpu_count=gpus, ops=ops)
    state = RunState(selection=Selection(profile, node, "t"), scratch=".", scratch_is_temp=False,
                     results=None, started="")
    state.op_cache.update(compatible)
    return state


def test_ops_to_build_adds_the_ops_gpu_tests_load_on_gpu_nodes_only(outside_xdist):
    from dsconform.gate.requires import requires
    from dsconform.plugin.items import ops_to_build

    items = [_Item("suites/test_ops.py"),
             _Item("suites/test_checkpoint.py", pytest.mark.gpu,
                   requires(op=["async_io", "utils"])),
             _Item("suites/test_zero.py", requires(op="cpu_adam"))]  # a CPU cell: not built
    ops, compatible = ("cpu_adam", "async_io"), dict(cpu_adam=True, async_io=True, utils=True)
    gpu, cpu = _run_state(2, ops, compatible), _run_state(0, ops, compatible)
    assert ops_to_build(items, gpu) == ["cpu_adam", "async_io", "utils"]
    assert ops_to_build(items, cpu) == ["cpu_adam", "async_io"]
    assert ops_to_build(items[1:], gpu) == ["async_io", "utils"]
    assert ops_to_build(items[1:], cpu) == []


def test_available_cores_is_this_process_share():
    assert 1 <= opbuild.available_cores() <= (os.cpu_count() or 1)


def test_a_test_waits_at_setup_for_the_builds_of_the_ops_it_loads(monkeypatch):
    """A test whose ranks load an op this run still builds waits for that build at setup (a
    rank that loaded it first would build it itself, unseen by the scheduler); a test the gate
    skips does not wait."""
    from types import SimpleNamespace

    from dsconform.plugin import hooks

    waited = []
    verdicts = [None]
    state = SimpleNamespace(op_builds=SimpleNamespace(wait=waited.append),
                            verdict=lambda item: verdicts[0])
    monkeypatch.setattr(hooks, "run_state", lambda config: state)
    monkeypatch.setattr(hooks.gating, "item_ops", lambda item: ["async_io", "utils"])
    hooks.pytest_runtest_setup(SimpleNamespace(config=None, stash={}))
    assert waited == ["async_io", "utils"]
    verdicts[0] = SimpleNamespace(broken_promises=[], ok=False, skip_reason="not promised")
    with pytest.raises(pytest.skip.Exception):
        hooks.pytest_runtest_setup(SimpleNamespace(config=None, stash={}))
    assert waited == ["async_io", "utils"]


def test_ops_of_gpu_tests_that_will_skip_are_not_built(outside_xdist):
    """A GPU test skipped by a static mark (NVME-GDS-2 on a profile without NVMe paths) or by an
    unmet need other than its ops (two GPUs on a one-GPU node) loads nothing: its ops are not
    built for it. One whose only unmet need is its op is built: its failure is the test's."""
    from dsconform.gate.requires import requires
    from dsconform.plugin.items import ops_to_build

    state = _run_state(1, ("cpu_adam",), dict(gds=True, utils=True, async_io=True,
                                              fused_adam=False))
    gpu = pytest.mark.gpu
    skipped = _Item("suites/test_deepnvme.py", gpu, requires(op="gds"),
                    pytest.mark.skip(reason="Requires: [NVMe path in profile]"))
    two_gpus = _Item("suites/test_checkpoint.py", gpu, requires(min_gpus=2, op="utils"))
    runs = _Item("suites/test_deepnvme.py", gpu, requires(op="async_io"))
    unbuildable = _Item("suites/test_zero.py", gpu, requires(op="fused_adam"))
    assert ops_to_build([skipped, two_gpus, runs, unbuildable], state) == \
        ["async_io", "fused_adam"]




def test_the_promised_ops_build_from_the_start_only_where_the_ops_suite_surely_runs(pytester):
    """The run's arguments name the ops suite (its file, or a folder above it) and nothing
    can deselect it: its promised ops are built as the run configures, not after collection."""
    from dsconform.plugin.hooks import _runs_ops_suite

    pytester.mkdir("suites")
    for name in ("test_ops.py", "test_zero.py"):
        (pytester.path / "suites" / name).write_text("def test_x():\n    pass\n")

    def runs(*args: str) -> bool:
        return _runs_ops_suite(pytester.parseconfig(*args))

    assert runs(".") and runs("suites") and runs("suites/test_ops.py")
    assert runs("suites/test_ops.py::test_x") and runs("suites/test_zero.py", "suites")
    assert not runs("suites/test_zero.py")
    assert not runs("suites", "-k", "zero") and not runs("suites", "--deselect", "suites/x")
    assert not runs("suites", "-n", "2")
