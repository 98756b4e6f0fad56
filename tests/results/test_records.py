"""Benchmark records and TOML output."""

from __future__ import annotations

import math
import tomllib

import pytest

from dsconform.profile import toml_writer as toml_out
from dsconform.results import records


def test_stats_of_samples():
    s = records.stats([3.0, 1.0, 2.0, 4.0])
    assert (s["min"], s["max"], s["mean"], s["rounds"]) == (1.0, 4.0, 2.5, 4)
    assert s["median"] == 2.5 and s["data"] == [3.0, 1.0, 2.0, 4.0]
    one = records.stats([7.0])
    assert one["stddev"] == 0.0 and one["median"] == 7.0 and one["iqr"] == 0.0


def test_metric_rejects_bad_direction_and_empty():
    with pytest.raises(ValueError, match="better must be one of"):
        records.Metric("t::x", "bw", [1.0], "GB/s", "up")
    with pytest.raises(ValueError, match="no samples"):
        records.Metric("t::x", "bw", [], "GB/s", "higher")


def test_document_is_pytest_benchmark_shaped():
    m = records.Metric("suites/test_x.py::test_a[cpu]", "write_gbps", [1.0, 2.0], "GB/s",
                       "higher", 0.5, {"bytes": 10}, "deepnvme")
    o = records.Outcome("suites/test_x.py::test_a[cpu]", "passed", "deepnvme")
    doc = records.document([m], [o], machine_info={"node": "n"}, commit_info={},
                           profile={"name": "p"})
    for key in ("machine_info", "commit_info", "benchmarks", "datetime", "version"):
        assert key in doc
    [b] = doc["benchmarks"]
    assert b["fullname"] == "suites/test_x.py::test_a[cpu]::write_gbps" and b["group"] == "deepnvme"
    assert b["extra_info"]["better"] == "higher" and b["extra_info"]["limit"] == 0.5
    assert doc["dsconform"]["outcomes"][0]["outcome"] == "passed"


def test_toml_roundtrip():
    data = {"profile": {"name": 'q"uote', "description": "x"},
            "gpus": {"count": 2, "bf16": True, "min_memory_gib": 139.5},
            "nccl": {"min_version": "2.21", "floors": [
                {"collective": "all_reduce", "bytes": 1 << 30, "busbw_gbps": 300.0}]},
            "deepspeed": {"ops": ["a", "b"]}}
    assert tomllib.loads(toml_out.dumps(data)) == data
    with pytest.raises(ValueError):
        toml_out.dumps({"t": {"x": float("nan")}})


# ------------------------------------------------------------------ limits, enforced in one place

def _recorder():
    kept = []
    return records.MetricsRecorder("suites/test_x.py::test_a", "x", kept.append), kept


def test_a_floor_is_held_to_the_median_and_named_with_value_and_parameters():
    rec, kept = _recorder()
    m = rec.record_rate("all_reduce.busbw", [0.010, 0.011, 0.012], amount=4e9, unit="GB/s",
                        scale=1e9, floor=380.0, bytes=4 << 30, world_size=2)
    assert kept == [m] and m.unit == "s" and m.better == "lower"  # stats hold the times
    assert [round(r, 1) for r in m.rate_samples] == [400.0, 363.6, 333.3]
    [v] = rec.violations()
    assert v.startswith("all_reduce.busbw = 363.6 GB/s (median of 3 rounds: 400, 363.6, 333.3) "
                        "is below its floor 380 GB/s")
    assert "bytes=4294967296, world_size=2" in v
    with pytest.raises(AssertionError, match="below its floor 380"):
        rec.check()
    ok, _ = _recorder()
    ok.record_rate("all_reduce.busbw", [0.010, 0.010, 0.011], amount=4e9, unit="GB/s",
                   scale=1e9, floor=380.0)
    assert ok.violations() == []


def test_a_ceiling_and_a_floor_on_plain_values():
    rec, _ = _recorder()
    rec.record("step_seconds", [0.2, 0.3, 0.9], unit="s", better="lower", limit=0.25)
    rec.record("zero.grad_max_abs_diff", 1e-3, unit="1", better="lower", limit=1e-2)
    rec.record("tflops", [700.0, 705.0, 690.0], unit="TFLOPS", better="higher", limit=720.0)
    found = rec.violations()
    assert len(found) == 2
    assert "step_seconds = 0.3 s" in found[0] and "ceiling 0.25 s" in found[0]
    assert "tflops = 700 TFLOPS" in found[1] and "floor 720 TFLOPS" in found[1]


def test_nan_is_beyond_every_limit():
    rec, _ = _recorder()
    rec.record("zero.grad_max_abs_diff", float("nan"), unit="1", better="lower", limit=1e-2)
    rec.record("ratio", float("nan"), unit="ratio", better="higher", limit=0.9)
    found = rec.violations()
    assert len(found) == 2
    assert "zero.grad_max_abs_diff = nan 1" in found[0] and "ceiling 0.01" in found[0]
    assert "ratio = nan ratio" in found[1] and "floor 0.9" in found[1]


@pytest.mark.parametrize("broken", [0.0, -1e-6, float("nan"), float("inf")])
def test_a_broken_timer_never_beats_a_floor(broken):
    """A round timed at zero, negative, NaN or infinite seconds has no rate: a floor fails,
    naming it (a rate of inf from a zero time once beat every floor)."""
    rec, _ = _recorder()
    m = rec.record_rate("read", [0.01, broken, broken], amount=1e9, unit="GB/s", scale=1e9,
                        floor=50.0)
    assert all(math.isnan(r) for r in m.rate_samples[1:])
    [v] = rec.violations()
    assert f"read: 2 of 3 rounds took {broken!r}, {broken!r} s, not a positive finite time" in v
    assert "floor 50 GB/s" in v


def test_a_performance_limit_needs_three_rounds():
    rec, kept = _recorder()
    with pytest.raises(ValueError, match="at least 3 rounds, got 1"):
        rec.record("write_gbps", 2.0, unit="GB/s", better="higher", limit=1.0)
    with pytest.raises(ValueError, match="at least 3 rounds, got 2"):
        rec.record_rate("read", [1.0, 1.0], amount=1e9, unit="GB/s", scale=1e9, floor=0.5)
    assert kept == []
    rec.record("build_seconds", 40.0, unit="s", better="lower")  # no limit: one value is fine


def test_rate_travels_as_json_and_back():
    from dataclasses import asdict

    rec, kept = _recorder()
    m = rec.record_rate("read", [1.0, 2.0, 4.0], amount=8e9, unit="GB/s", scale=1e9, floor=1.0)
    again = records.Metric(**asdict(m))
    assert again.rate == m.rate and again.rate_samples == [8.0, 4.0, 2.0]
    entry = records.benchmark_entry(again)
    assert entry["stats"]["median"] == 2.0  # seconds: what pytest-benchmark reads
    rate = entry["extra_info"]["rate"]
    assert (rate["unit"], rate["better"], rate["limit"], rate["median"]) == ("GB/s", "higher",
                                                                             1.0, 4.0)
