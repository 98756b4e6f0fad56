"""Parallel op builds at run start: results per op, failures carried to the op's test."""

from __future__ import annotations

from dsconform.ops.prebuild import ParallelBuilds


def test_parallel_builds_report_each_op():
    builds = ParallelBuilds.start(["cpu_adam", "no_such_op"], cores=2)
    try:
        assert builds.jobs_per_op == 1  # 2 cores shared by 2 builds
        ok = builds.wait("cpu_adam")
        assert ok["loaded"] and ok["failure"] is None and ok["build_seconds"] > 0
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
    import time

    from dsconform.ops import prebuild as opbuild

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


class _Item:
    """Just enough of a collected test for ops_to_build."""

    def __init__(self, path: str, *marks) -> None:
        self.fspath = path
        self._marks = [m.mark for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self._marks if m.name == name), None)

    def iter_markers(self, name=None):
        return (m for m in self._marks if name is None or m.name == name)


def test_ops_to_build_adds_the_ops_gpu_tests_load_on_gpu_nodes_only():
    from types import SimpleNamespace

    import pytest

    from dsconform.gate.requires import requires
    from dsconform.plugin.hooks import ops_to_build

    items = [_Item("suites/test_ops.py"),
             _Item("suites/test_checkpoint.py", pytest.mark.gpu,
                   requires(op=["async_io", "utils"])),
             _Item("suites/test_zero.py", requires(op="cpu_adam"))]  # a CPU cell: not built
    profile = SimpleNamespace(ops=["cpu_adam", "async_io"])
    gpu = SimpleNamespace(profile=profile, node=SimpleNamespace(gpu_count=2))
    cpu = SimpleNamespace(profile=profile, node=SimpleNamespace(gpu_count=0))
    assert ops_to_build(items, gpu) == ["cpu_adam", "async_io", "utils"]
    assert ops_to_build(items, cpu) == ["cpu_adam", "async_io"]
    assert ops_to_build(items[1:], gpu) == ["async_io", "utils"]
    assert ops_to_build(items[1:], cpu) == []
