"""Noisy neighbours (dsconform.node.neighbours, PROF-GPU-8/9): another process computing on a
GPU MUST fail the run, named by pid and process name; the run's own processes never do.
NVML is faked here (this machine has no GPU); the process tree is real."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from dsconform.node import neighbours
from dsconform.node.detect import GpuHardware, GpuInfo, GpuProcess, NodeFacts
from suites import test_profile

H200 = 143771 << 20


def _node(compute=(), utilization=(0,)) -> NodeFacts:
    return NodeFacts(hostname="h", python="3.12", cpu_cores=16, host_memory_bytes=128 << 30,
                     shm_bytes=64 << 30, torch_version="2.11", deepspeed_version="0.19.8",
                     gpus=[GpuInfo("NVIDIA H200", H200, "9.0")],
                     hardware=GpuHardware(count=1, source="nvml", models=["NVIDIA H200"],
                                          bus_ids=["0000:00:06.0"]),
                     compute_at_start=list(compute), utilization_at_start=list(utilization))


PROFILE = SimpleNamespace(gpu_count=1, name="auto-h200-x1")


def test_a_process_computing_at_the_start_fails_naming_it():
    other = GpuProcess(0, 4242, "python3", 1002 << 20)
    with pytest.raises(AssertionError, match=r"GPU 0 \(0000:00:06.0\): pid 4242 \(python3, "
                                             r"1002 MiB\)"):
        test_profile.test_no_neighbour_at_start(PROFILE, _node([other]))
    test_profile.test_no_neighbour_at_start(PROFILE, _node())  # the control: an idle GPU


def test_a_busy_gpu_whose_process_is_invisible_fails_by_its_utilization():
    """In a container NVML may list no process of another container: the idle sample shows it."""
    with pytest.raises(AssertionError, match=r"GPU 0 \(0000:00:06.0\): 97% utilization"):
        test_profile.test_no_neighbour_at_start(PROFILE, _node(utilization=[97]))
    test_profile.test_no_neighbour_at_start(PROFILE, _node(utilization=[3]))


def test_unreadable_nvml_at_start_fails():
    with pytest.raises(pytest.fail.Exception, match="NVML could not be read"):
        test_profile.test_no_neighbour_at_start(PROFILE, _node(utilization=[]))


def test_the_run_own_processes_are_not_neighbours():
    ours = {os.getpid(), 10, 11}
    procs = [GpuProcess(0, 10, "rank"), GpuProcess(0, 99, "other")]
    assert [p.pid for p in neighbours.neighbours(procs, ours)] == [99]


def test_the_process_tree_below_the_run_root_is_the_run_own():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in neighbours.own_pids(neighbours.run_root())
        assert 1 not in neighbours.own_pids(neighbours.run_root())
    finally:
        child.kill()
        child.wait()


def test_the_watch_names_a_neighbour_that_starts_during_the_run():
    polls = []

    def read():
        polls.append(1)
        if len(polls) >= 3:  # the neighbour arrives mid-run
            return [GpuProcess(0, 7, "rank"), GpuProcess(0, 4242, "stress", 1 << 30)]
        return [GpuProcess(0, 7, "rank")]

    watch = neighbours.NeighbourWatch(read, lambda: {7}, poll_s=0.01).start()
    time.sleep(0.2)
    watch.stop()
    [seen] = watch.found()
    assert seen.process.pid == 4242 and watch.polls >= 3
    text = seen.describe(["0000:00:06.0"])
    assert text.startswith("GPU 0 (0000:00:06.0): pid 4242 (stress, 1024 MiB), first seen")
    run = SimpleNamespace(neighbours=watch)
    with pytest.raises(AssertionError, match=r"pid 4242 \(stress"):
        test_profile.test_no_neighbour_during_the_run(PROFILE, _node(), run)


def test_a_pid_once_seen_as_the_run_own_stays_its_own():
    """A rank that exited between two polls is not a neighbour when NVML still lists it."""
    ours = [{7}]
    watch = neighbours.NeighbourWatch(lambda: [GpuProcess(0, 7, "rank")], lambda: ours[0])
    watch.poll()
    ours[0] = set()  # the rank is gone from the tree
    watch.poll()
    assert watch.found() == []


def test_a_quiet_run_passes_and_an_unread_one_fails():
    quiet = neighbours.NeighbourWatch(lambda: [], set)
    quiet.poll()
    test_profile.test_no_neighbour_during_the_run(PROFILE, _node(),
                                                  SimpleNamespace(neighbours=quiet))

    def broken():
        raise RuntimeError("NVML Shutdown")
    blind = neighbours.NeighbourWatch(broken, set)
    with pytest.raises(pytest.fail.Exception, match="could not be read during the run"):
        test_profile.test_no_neighbour_during_the_run(PROFILE, _node(),
                                                      SimpleNamespace(neighbours=blind))
