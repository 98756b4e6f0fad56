"""The collectives suite's checks MUST go red, on real gloo collectives (2 ranks, CPU).

Each test runs the suite's own rank code (dsconform/checks/collective_calls.py,
suites/collective_ranks.py) and its own checking and recording helpers
(suites/test_collectives.py) with a fault injected in one rank:
- one element of one rank's deepspeed.comm result off by one: the exactness check names rank,
  collective, dtype, size and index (COLL-EXACT-1);
- every rank carrying the collective in another dtype (its tensors cast down, the real gloo
  collective run in it, the result cast back): bf16 in fp16, fp16 in bf16, fp32 in either
  (COLL-EXACT-1's data is exact in no other dtype);
- one rank late to every collective call: the recorder fails ``<collective>.waited_for_pct``
  for that rank only (COLL-STRAG-1);
- one rank's sends delayed: the link from it fails ``p2p.pct_of_peer_median`` (COLL-P2P-1);
- one rank's matmuls slowed: its ``matmul.<dtype>.pct_of_peer_median`` fails, and a TFLOPS
  floor far above the machine fails both ranks (GPU-MATMUL-1);
- a busbw floor far above the machine: the test fails through the plugin's recorder with the
  metric, value, floor and size (COLL-BW-2).
Nothing here is mocked: gloo moves the data, the recorder enforces the limits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsconform.checks import collectives
from dsconform.harness.api import run_ranks
from dsconform.node import gpu_health
from dsconform.results.records import MetricsRecorder
from dsconform.suite import collective_calls
from suites import collective_ranks
from suites.test_collectives import (
    EXACT_SIZES,
    check_exact,
    record_links,
    record_matmul,
    record_point,
)

WORLD = 2
PCT = gpu_health.DEFAULT_STRAGGLER_PCT
MIB = 1 << 20


def _recorder() -> MetricsRecorder:
    return MetricsRecorder("tests/suites/test_collectives_red.py::t", "collectives", lambda m: None)


def _ids(result: dict) -> list[gpu_health.GpuIdentity]:
    return gpu_health.identify(result["identities"])


# The suite's ``node`` as far as check_exact reads it: this CPU machine has no NVML bus ids.
_Node = SimpleNamespace(hardware=SimpleNamespace(bus_ids=[]))


@pytest.mark.parametrize("collective, dtype", [
    ("all_reduce", "fp32"), ("all_gather", "bf16"), ("reduce_scatter", "fp16"),
    ("broadcast", "bf16"), ("all_to_all", "fp16")])
def test_one_wrong_element_fails_naming_rank_collective_dtype_size_index(collective, dtype):
    """A rank whose collective returns one wrong element MUST fail naming all of it."""
    perturb = {"rank": 1, "numel": 53, "index": 17}
    assert not check_exact(collective, dtype, "cpu", WORLD, _Node)  # the control
    [m] = check_exact(collective, dtype, "cpu", WORLD, _Node, perturb=perturb)
    assert (m.rank, m.collective, m.dtype, m.numel, m.index, m.wrong) == (
        1, collective, dtype, 53, 17, 1)
    assert m.found == m.expected + collectives.unit(dtype)  # one unit of the data
    text = m.describe()
    assert text.startswith(f"{collective} {dtype} numel=53 (")
    assert f"rank 1 on rank 1 (cpu): element 17 is {m.found:.9g}, expected {m.expected:.9g}" \
           in text


@pytest.mark.parametrize("collective, dtype, narrow", [
    ("all_reduce", "fp32", "bf16"), ("all_reduce", "fp32", "fp16"),
    ("all_gather", "fp32", "bf16"), ("reduce_scatter", "fp16", "bf16"),
    ("broadcast", "fp16", "bf16"), ("all_to_all", "fp32", "fp16")])
def test_data_carried_in_a_narrower_type_fails(collective, dtype, narrow):
    """A rank whose collective rounds its output through a narrower type (a compression hook,
    a wrong NCCL datatype) MUST fail: the exact data needs the dtype's full precision."""
    [m] = check_exact(collective, dtype, "cpu", WORLD, _Node,
                      perturb={"rank": 1, "numel": 53, "narrow": narrow})
    assert (m.rank, m.collective, m.dtype, m.numel) == (1, collective, dtype, 53)
    assert m.wrong > m.total // 4, m.describe()


@pytest.mark.parametrize("collective, dtype, carrier", [
    ("all_reduce", "bf16", "fp16"), ("all_reduce", "fp16", "bf16"),
    ("all_reduce", "fp32", "bf16"), ("all_reduce", "fp32", "fp16"),
    ("reduce_scatter", "bf16", "fp16"), ("all_gather", "fp16", "bf16")])
def test_collective_carried_in_another_dtype_fails(collective, dtype, carrier):
    """A collective carried in another dtype than its data's, cast down and back around the
    real gloo collective on every rank, MUST fail on every rank, at every element."""
    found = check_exact(collective, dtype, "cpu", WORLD, _Node,
                        perturb={"numel": 53, "carry": carrier})
    assert {m.rank for m in found} == {0, 1}, [m.describe() for m in found]
    for m in found:
        assert (m.collective, m.dtype, m.numel) == (collective, dtype, 53)
        padding = {"reduce_scatter": m.rank == 1, "all_gather": 1}.get(collective, 0)
        assert m.wrong == m.total - padding, m.describe()  # all but ZeRO's padding (zeros)


def test_a_fault_only_in_large_messages_is_found_on_cpu_too():
    """A collective that goes wrong only above 128 Ki elements (a protocol or chunking switch):
    the CPU sizes reach past it (a mutation audit found 65537 elements the largest)."""
    big = max(EXACT_SIZES["cpu"])
    assert big > 1 << 17
    [m] = check_exact("all_reduce", "fp32", "cpu", WORLD, _Node,
                      perturb={"rank": 1, "numel": big, "index": big - 2})
    assert (m.numel, m.index) == (big, big - 2)


def _measure(delay_rank: int | None, collective: str = "all_reduce") -> dict:
    return run_ranks(collective_calls.measure, WORLD, timeout_s=300,
                     args=(collective, [(MIB, 5)]),
                     kwargs={"delay_rank": delay_rank, "delay_s": 0.05}, accelerator="cpu")[0]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter",
                                        "broadcast", "all_to_all"])
def test_a_fast_but_partial_collective_fails_its_timed_point(collective):
    """A collective that leaves part of its output undone (fast, so it would pass a floor) MUST
    fail the bandwidth point it was timed at, naming the rank and the wrong elements."""
    ok = run_ranks(collective_calls.measure, WORLD, timeout_s=300, args=(collective, [(MIB, 3)]),
                   accelerator="cpu")[0]
    bad = run_ranks(collective_calls.measure, WORLD, timeout_s=300,
                    args=(collective, [(MIB, 3)]), kwargs={"partial_rank": 1},
                    accelerator="cpu")[0]
    record_point(_recorder(), collective, ok["points"][0], _ids(ok), 99.0, bytes=MIB)  # control
    assert ok["points"][0]["wrong"] == [0, 0]
    with pytest.raises(AssertionError) as err:
        record_point(_recorder(), collective, bad["points"][0], _ids(bad), 99.0, bytes=MIB)
    assert f"{collective} at {MIB} bytes returned wrong values" in str(err.value)
    assert "rank 1" in str(err.value) and bad["points"][0]["wrong"][0] == 0


@pytest.mark.parametrize("late", [0, 1])
def test_late_rank_fails_naming_it(late):
    """A rank its peers wait for MUST fail waited_for_pct, naming that rank and no other."""
    result = _measure(late)
    metrics = _recorder()
    record_point(metrics, "all_reduce", result["points"][0], _ids(result), PCT, bytes=MIB,
                 world_size=WORLD)
    [violation] = metrics.violations()
    assert violation.startswith("all_reduce.waited_for_pct = ")
    assert f"is beyond its ceiling {PCT:g} %" in violation
    assert f"rank={late}," in violation and f"who=rank {late} (cpu)" in violation


def test_punctual_ranks_pass():
    """The control: without the delay no rank is named (gloo on a loaded 2-core machine)."""
    result = _measure(None)
    metrics = _recorder()
    record_point(metrics, "all_reduce", result["points"][0], _ids(result), PCT, bytes=MIB,
                 world_size=WORLD)
    assert not metrics.violations()
    names = [m.name for m in metrics.recorded]
    assert names.count("all_reduce.rank_seconds") == WORLD
    assert all(len(m.samples) == 3 for m in metrics.recorded)


def test_slow_link_fails_naming_both_ends():
    """A link from a slow sender MUST fail p2p.pct_of_peer_median, naming src and dst."""
    result = run_ranks(collective_ranks.measure_pairs, WORLD, timeout_s=300, args=(MIB, 5),
                       kwargs={"delay_rank": 1, "delay_s": 0.05}, accelerator="cpu")[0]
    assert [(link["src"], link["dst"]) for link in result["links"]] == [(0, 1), (1, 0)]
    metrics = _recorder()
    record_links(metrics, result, _ids(result), PCT, world_size=WORLD)
    [violation] = metrics.violations()
    assert violation.startswith("p2p.pct_of_peer_median = ")
    assert "link=rank 1 (cpu) -> rank 0 (cpu)" in violation
    assert "src_rank=1" in violation and "dst_rank=0" in violation


def test_slow_gpu_matmul_and_a_floor_above_the_machine_fail():
    """A rank slower at matmul than its peer MUST fail, and so MUST a TFLOPS floor it misses."""
    results = run_ranks(collective_ranks.matmul_seconds, WORLD, timeout_s=300,
                        args=("fp32", 128, 5),
                        kwargs={"delay_rank": 0, "delay_s": 0.1, "warmup": 2},
                        accelerator="cpu")
    ids = gpu_health.identify([r["identity"] for r in results])
    metrics = _recorder()
    record_matmul(metrics, "fp32", results, ids, floor=1e6, straggler_pct=PCT, world_size=WORLD)
    found = metrics.violations()
    slow = [v for v in found if v.startswith("matmul.fp32.pct_of_peer_median")]
    assert len(slow) == 1 and "who=rank 0 (cpu)" in slow[0], found
    floors = [v for v in found if v.startswith("matmul.fp32 = ")]
    assert len(floors) == WORLD and all("is below its floor 1e+06 TFLOPS" in v for v in floors)


SUITE_LIKE = '''
from dsconform.checks import collectives
from dsconform.suite import collective_calls, gpu_health, run_ranks
from suites.test_collectives import record_point

def test_floor_far_above(metrics):
    result = run_ranks(collective_calls.measure, 2, timeout_s=300,
                       args=("all_reduce", [(1 << 20, 5)]), accelerator="cpu")[0]
    ids = gpu_health.identify(result["identities"])
    record_point(metrics, "all_reduce", result["points"][0], ids, 99.0, floor=1e6,
                 bytes=1 << 20, world_size=2)
'''


def test_busbw_floor_far_above_the_machine_fails_through_the_recorder(pytester, tmp_path):
    """The suite's floor path (record_point with the floor) MUST fail the test, via the
    plugin's recorder, naming metric, measured value, floor and size."""
    pytester.makepyfile(test_floor=SUITE_LIKE)
    prof = tmp_path / "p0.toml"
    prof.write_text('[profile]\nname = "p0"\n[gpus]\ncount = 0\n')
    result = pytester.runpytest("-p", "fixtures.plugin", "--profile", str(prof))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*recorded beyond its limit: all_reduce.busbw = * GB/s (median of 3 rounds: *) is "
        "below its floor 1e+06 GB/s [[]bytes=1048576, world_size=2, amount=1048576.0[]]*"])


def test_a_gpu_that_slows_down_under_sustained_load_fails():
    """GPU-MATMUL-2's check on real (gloo, CPU) matmuls: a rank that slows to 50 ms a product
    for the last 40% of the run MUST fail its sustained_pct_of_start, naming it. (The healthy
    rank is not judged here: on a shared 2-core machine a 256x256 product took 0.15-8 ms within
    one run, so its own speed drifts by more than the 20% allowed; on 1xH200 the check read
    99.6-100.0%.)"""
    from suites.test_collectives import record_sustained

    results = run_ranks(collective_ranks.matmul_sustained, WORLD, timeout_s=300,
                        args=("fp32", 256, 4.0), kwargs={"window_s": 0.2, "throttle_rank": 1,
                                                         "throttle_after": 0.6},
                        accelerator="cpu")
    ids = gpu_health.identify([r["identity"] for r in results])
    metrics = _recorder()
    record_sustained(metrics, "fp32", results, ids, None, PCT, sustain_s=4.0, world_size=WORLD)
    found = [v for v in metrics.violations() if "who=rank 1 (cpu)" in v]
    assert len(found) == 1 and found[0].startswith("matmul.fp32.sustained_pct_of_start"), found
    assert "beyond its floor 80 %" in found[0], found


def test_slowdown_reasons_read_under_load_are_named():
    """What ClockEvents read while the matmul ran: a thermal or power-brake bit names the GPU;
    a software power cap (the usual state of a GPU at full load) or idle does not."""
    ids = [gpu_health.GpuIdentity(rank=0, device="cuda:0", bus_id="0000:06:00.0", gpu=0),
           gpu_health.GpuIdentity(rank=1, device="cuda:1", bus_id="0000:07:00.0", gpu=1)]
    results = [{"clock_events_mask": 0x40 | 0x4, "clock_event_samples": 12},
               {"clock_events_mask": 0x4 | 0x1, "clock_event_samples": 12}]
    [line] = gpu_health.slowdowns_under_load(results, ids, "the bf16 matmul")
    assert line.startswith("GPU 0 (PCI 0000:06:00.0): hardware thermal slowdown")
    assert line.endswith("while the bf16 matmul ran (12 readings)")
    assert gpu_health.slowdowns_under_load([{"clock_events_mask": None}], ids[:1], "x") == []
    # A GPU whose reasons were never read cannot pass as "no slowdown": it is named.
    unread = [{"clock_events_mask": None, "clock_events_why": "NVML unavailable: x"},
              {"clock_events_mask": 0, "clock_event_samples": 0}]
    assert gpu_health.unread_clock_events(unread, ids) == [
        "GPU 0 (PCI 0000:06:00.0, rank 0): NVML unavailable: x",
        "GPU 1 (PCI 0000:07:00.0, rank 1): not read"]
    assert gpu_health.unread_clock_events(results, ids) == []
