"""Parallel op builds at run start: results per op, failures carried to the op's test."""

from __future__ import annotations

from dsconform.opbuild import ParallelBuilds


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
