"""GPU-HBM-1 / GPU-PCIE-1 MUST fail a slow memory, a slow host link, a straggler GPU and a PCIe
link that trained down, naming the GPU. The rates and NVML's link readings are faked (this
machine has no GPU); the rank function runs for real on CPU ranks."""

from __future__ import annotations

import pytest

from dsconform.harness.api import run_ranks
from dsconform.node import gpu_health
from dsconform.profile import catalogue
from dsconform.results.records import MetricsRecorder
from suites import gpu_ranks, test_gpu

H200 = catalogue.shipped()["h200"]
GIB = 1 << 30


class _Profile:
    hbm_gbps = H200.floor("hbm_gbps")
    h2d_gbps = H200.floor("h2d_gbps")
    d2h_gbps = H200.floor("d2h_gbps")
    straggler_pct = 10


def _result(rank: int, hbm_gbps: float, h2d_gbps: float, d2h_gbps: float,
            gen: int = 5, width: int = 16) -> dict:
    """What copy_seconds reports for a GPU with these rates (5 rounds, 4 GiB / 2 GiB)."""
    def secs(amount, gbps):
        return [amount / 1e9 / gbps] * 5
    return {"identity": {"rank": rank, "device": f"cuda:{rank}",
                         "bus_id": f"0000:0{rank}:00.0"},
            "hbm_bytes": 4 * GIB, "hbm_seconds": secs(2 * 4 * GIB, hbm_gbps),
            "host_bytes": 2 * GIB, "h2d_seconds": secs(2 * GIB, h2d_gbps),
            "d2h_seconds": secs(2 * GIB, d2h_gbps),
            "pcie": {"gen": gen, "width": width, "max_gen": 5, "max_width": 16, "samples": 40,
                     "why": ""}}


def _judge(results: list[dict]) -> list[str]:
    rec = MetricsRecorder("t::t", "gpu", lambda m: None)
    ids = gpu_health.identify([r["identity"] for r in results],
                              [r["identity"]["bus_id"] for r in results])
    test_gpu.record_copies(rec, results, ids, _Profile(), 10.0)
    return rec.violations() + test_gpu.link_problems(results, ids)


def test_healthy_gpus_pass():
    assert _judge([_result(0, 4250, 55.3, 55.3), _result(1, 4230, 55.1, 55.2)]) == []


def test_a_gpu_with_half_its_memory_bandwidth_fails_naming_it():
    found = _judge([_result(0, 2100, 55.3, 55.3)])
    assert len(found) == 1 and "gpu.hbm" in found[0] and "GPU 0 (PCI 0000:00:00.0" in found[0]
    assert f"below its floor {H200.floor('hbm_gbps'):g}" in found[0], found


def test_a_slow_host_link_fails_each_direction():
    found = _judge([_result(0, 4250, 30.0, 55.3), _result(1, 4250, 55.3, 25.0)])
    assert any("gpu.h2d" in f and "GPU 0" in f for f in found), found
    assert any("gpu.d2h" in f and "GPU 1" in f for f in found), found


def test_a_straggler_above_every_floor_fails_against_its_peers():
    found = _judge([_result(0, 4250, 55.3, 55.3), _result(1, 4250, 55.3, 55.3),
                    _result(2, 3700, 55.3, 55.3)])
    assert len(found) == 1 and "gpu.hbm.pct_of_peer_median" in found[0] and "GPU 2" in found[0]


def test_a_link_trained_down_fails_even_at_its_floor():
    found = _judge([_result(0, 4250, 55.3, 55.3, gen=4), _result(1, 4250, 55.3, 55.3,
                                                                width=8)])
    assert any("GPU 0" in f and "Gen4 x16 under load" in f for f in found), found
    assert any("GPU 1" in f and "Gen5 x8 under load" in f for f in found), found


def test_an_unread_link_fails():
    res = _result(0, 4250, 55.3, 55.3)
    res["pcie"] = {"gen": None, "width": None, "max_gen": None, "max_width": None,
                   "samples": 0, "why": "NVML unavailable: boom"}
    [found] = _judge([res])
    assert "could not be read under load (NVML unavailable: boom)" in found


def test_the_rank_function_times_every_round_on_real_ranks():
    """copy_seconds on two CPU ranks: five timed rounds of each copy, the link unread (no
    GPU) and said so."""
    out = run_ranks(gpu_ranks.copy_seconds, 2, timeout_s=120, args=(1 << 20, 1 << 20, 5),
                    accelerator="cpu")
    for r in out:
        assert len(r["hbm_seconds"]) == 5 and all(s > 0 for s in r["hbm_seconds"])
        assert len(r["h2d_seconds"]) == 5 and len(r["d2h_seconds"]) == 5
        assert r["pcie"]["samples"] == 0 and r["pcie"]["why"]


@pytest.mark.parametrize(("memory", "expected"), [(143771 << 20, 4 * GIB),
                                                  (16 * GIB, 2 * GIB)])
def test_the_copy_fits_small_gpus(memory, expected):
    from dsconform.node.detect import GpuInfo

    class Node:
        gpus = [GpuInfo("g", memory, "9.0")]
    assert test_gpu.hbm_bytes(Node()) == expected
