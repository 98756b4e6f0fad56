"""Collectives: torch.distributed collectives MUST be correct on every backend the node uses,
and MUST reach the bus bandwidth floors the profile promises, at the message size each floor
was measured with.

Bandwidths are GB/s (1e9 bytes/s); busbw follows nccl-tests (all_reduce: algbw * 2(n-1)/n;
all_gather, reduce_scatter, all_to_all: (n-1)/n; broadcast: 1). Floors are measured the way they
are checked: through torch.distributed, fp32, back-to-back calls (FINDINGS: at 1 MiB
torch.distributed reaches less than half of nccl-tests, so a floor from one tool does not
transfer to the other at small sizes).
Upstream: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md
"""

from __future__ import annotations

import pytest

from dsconform.suite import GB, accel_params, requires, run_ranks, run_state
from suites import collective_ranks

CAPABILITY = "collectives"


def _iters(nbytes: int) -> int:
    # About 20 GB moved per measurement: long enough to swamp launch jitter, short at 4 GiB.
    return max(5, min(200, int(2e10 // nbytes)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "floor" not in metafunc.fixturenames:
        return
    prof = run_state(metafunc.config).profile
    params = []
    for fl in prof.nccl_floors:
        ws = fl.world_size or prof.gpus_promised
        params.append(pytest.param(
            fl, id=f"{fl.collective}-{fl.bytes}B-{ws}gpu",
            marks=[pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.benchmark,
                   requires(min_gpus=ws)]))
    if not params:  # say why instead of pytest's "got empty parameter set"
        params = [pytest.param(None, id="none", marks=pytest.mark.skip(
            reason=f"profile {prof.name} promises no nccl.floors"))]
    metafunc.parametrize("floor", params)


@pytest.mark.parametrize("accel", accel_params(2))
def test_all_reduce_is_exact(accel):
    """all_reduce of small integers MUST be exact on every rank (2 ranks)."""
    worst = run_ranks(collective_ranks.all_reduce_is_exact, 2, timeout_s=120,
                      args=(1 << 20,), accelerator=accel)
    assert max(worst) == 0.0, f"all_reduce deviates from the exact sum by {max(worst)} per rank"


def test_busbw_floor(floor, profile, metrics):
    """Bus bandwidth MUST reach the profile's floor for that collective and message size."""
    ws = floor.world_size or profile.gpus_promised
    iters = _iters(floor.bytes)
    result = run_ranks(collective_ranks.measure_busbw, ws, timeout_s=300,
                       args=(floor.collective, floor.bytes, iters), accelerator="cuda")[0]
    # busbw = bytes * bus factor / time (nccl-tests); the recorder holds the median of 3 rounds
    # to the floor and names collective, size and world size when it is missed.
    metrics.record_rate(f"{floor.collective}.busbw", result["seconds"],
                        amount=floor.bytes * result["bus_factor"], unit="GB/s", scale=GB,
                        floor=floor.busbw_gbps, bytes=floor.bytes, world_size=ws, iters=iters,
                        source=floor.source or "profile")
