"""Benchmark records and TOML output."""

from __future__ import annotations

import tomllib

import pytest

from dsconform import records, toml_out


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
