"""The collectives suite's exactness checks MUST go through deepspeed.comm and MUST catch an
all_reduce that is wrong only on sizes that are a multiple of 8.

The fault (tests/perturbed_ranks.py ``aligned_tail_unreduced``): deepspeed.comm.all_reduce, on
both ranks, leaves the last 8 elements of a tensor whose size is a multiple of 8 unreduced, as a
vectorised kernel that skips its tail would; torch.distributed stays correct. The suite's own
rank code runs under it on real gloo collectives (2 ranks, CPU):

- COLL-EXACT-2 (aligned sizes) fails at every size, naming the API, the first wrong element
  (the tail's first) and both values, while torch.distributed beside it passes; the odd sizes
  of COLL-EXACT-1 cannot see this fault;
- COLL-EXACT-0 fails through deepspeed.comm, not through torch.distributed;
- the bandwidth sweep's checked call fails through deepspeed.comm.
And a mismatch message shows two fp32 values that differ in their last digits as different.
"""

from __future__ import annotations

import pytest

from dsconform.checks import collectives
from dsconform.harness.api import run_ranks
from dsconform.node import gpu_health
from dsconform.results.records import MetricsRecorder
from dsconform.suite import collective_calls
from suites import collective_ranks
from suites.test_collectives import EXACT_APIS, EXACT_SIZES, aligned_sizes, record_point
from tests.perturbed_ranks import TAIL, aligned_tail_unreduced

WORLD = 2
MIB = 1 << 20


def _exact(sizes: tuple[int, ...], dtype: str = "fp32") -> list[collectives.Mismatch]:
    results = run_ranks(aligned_tail_unreduced, WORLD, timeout_s=300,
                        args=(collective_calls.check_exact, "all_reduce", dtype, sizes),
                        kwargs={"apis": EXACT_APIS}, accelerator="cpu")
    return collectives.mismatches_from_ranks([r["mismatches"] for r in results])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_aligned_sizes_catch_a_wrong_tail_through_deepspeed_comm(dtype):
    sizes = aligned_sizes("cpu", WORLD)
    assert all(n % TAIL == 0 for n in sizes) and 129 * 8 * WORLD in sizes
    found = _exact(sizes, dtype)
    assert {m.api for m in found} == {"deepspeed.comm"}, [m.describe() for m in found]
    assert sorted((m.numel, m.rank) for m in found) == sorted(
        (n, r) for n in sizes for r in range(WORLD))
    for m in found:
        assert (m.index, m.wrong, m.total) == (m.numel - TAIL, TAIL, m.numel), m.describe()
        text = m.describe()
        assert text.startswith(f"all_reduce {dtype} numel={m.numel} ({m.numel} elements): rank "
                               f"{m.rank}: element {m.numel - TAIL} is {m.found:.9g}, expected "
                               f"{m.expected:.9g} ({TAIL} of {m.numel} elements wrong), off by "
                               f"{m.found - m.expected:+.9g}, through deepspeed.comm"), text
    # The odd sizes alone pass this fault: why the aligned sizes are checked.
    assert all(n % TAIL for n in EXACT_SIZES["cpu"])
    assert _exact(EXACT_SIZES["cpu"]) == []


def test_exact_all_reduce_fails_through_deepspeed_comm_only():
    worst = run_ranks(aligned_tail_unreduced, WORLD, timeout_s=300,
                      args=(collective_ranks.all_reduce_is_exact, 1 << 20), accelerator="cpu")
    assert [w["torch.distributed"] for w in worst] == [0.0, 0.0]
    # rank r's unreduced tail holds r + 1 where the sum 3 belongs
    assert [w["deepspeed.comm"] for w in worst] == [2.0, 1.0]


def test_sweep_output_check_fails_through_deepspeed_comm():
    result = run_ranks(aligned_tail_unreduced, WORLD, timeout_s=300,
                       args=(collective_calls.measure, "all_reduce", [(MIB, 3)]),
                       accelerator="cpu")[0]
    point = result["points"][0]
    assert point["wrong"] == [0, 0] and point["wrong_ds"] == [TAIL, TAIL]
    recorder = MetricsRecorder("tests/suites/test_collectives_aligned_red.py::t", "collectives",
                               lambda m: None)
    with pytest.raises(AssertionError) as err:
        record_point(recorder, "all_reduce", point, gpu_health.identify(result["identities"]),
                     99.0, bytes=MIB)
    assert str(err.value).splitlines()[0] == (
        f"all_reduce at {MIB} bytes returned wrong values through deepspeed.comm after the "
        f"timed calls (input rank + 1 on every rank): rank 0 (cpu): {TAIL} elements, rank 1 "
        f"(cpu): {TAIL} elements")


def test_a_mismatch_shows_the_digits_that_differ():
    # fp32 values one unit of 2**-10 apart print alike with :g ("-16384")
    found, expected = -16384.0 + 2.0 ** -10, -16384.0
    m = collectives.Mismatch("broadcast", "fp32", 64, 0, 0, expected, found, 1, 64,
                             "64 elements from rank 1")
    assert f"{found:g}" == f"{expected:g}"
    assert ("element 0 is -16383.999, expected -16384 (1 of 64 elements wrong), off by "
            "+0.0009765625, through deepspeed.comm") in m.describe()
