"""``dsconform aggregate``'s outliers are nodes slower than the median of their own node type
(profile and GPUs), on what ``dsconform compare`` judges: a 1-GPU node is no outlier of an
8-GPU fleet, and a cold op build (38 s against a warm 0.16 s load) or a 40 us collective's
time is no outlier at all."""

from __future__ import annotations

from pathlib import Path

from dsconform.results import aggregate, records
from dsconform.results.render import aggregate as aggregate_report
from tests.results.test_aggregate import BUSBW, busbw, outcome, write_node

LOAD = "suites/test_ops.py::test_promised_op[fused_adam]"


def op_load(seconds: float) -> records.Metric:
    """As the ops suite records it: one round, the build or load as it happened."""
    return records.Metric(LOAD, "fused_adam.load_seconds", [seconds], "s", "lower", None,
                          {}, "ops")


def latency(seconds: float) -> records.Metric:
    return records.Metric(BUSBW, "all_reduce.rank_seconds", [seconds] * 3, "s", "lower", None,
                          {"bytes": 1 << 20}, "collectives")


def node(root: Path, name: str, gbps: float, *metrics: records.Metric, **kind) -> None:
    write_node(root / name, outcomes=[outcome(BUSBW)], metrics=[busbw(gbps), *metrics], **kind)


def outliers(root: Path) -> set[tuple[str, str]]:
    report = aggregate.analyse(aggregate.collect([root]), outlier_pct=90)
    return {(o.node, o.metric.rsplit("::", 1)[-1]) for o in report.outliers}


def test_outliers_are_computed_within_each_node_type(tmp_path):
    """Three 8xH200 nodes at ~300 GB/s and three 8xH100 at ~150: across the fleet the H100s
    would all be outliers; within their type only the slow one of each is."""
    for name, gbps in (("h200-a", 300.0), ("h200-b", 305.0), ("h200-c", 240.0)):
        node(tmp_path, name, gbps)
    for name, gbps in (("h100-a", 150.0), ("h100-b", 152.0), ("h100-c", 120.0)):
        node(tmp_path, name, gbps, profile="h100-x8", gpus="NVIDIA H100")
    assert outliers(tmp_path) == {("h200-c", "all_reduce.busbw"),
                                  ("h100-c", "all_reduce.busbw")}
    report = aggregate.analyse(aggregate.collect([tmp_path]))
    [h100] = [o for o in report.outliers if o.node == "h100-c"]
    assert h100.node_type == "h100-x8, 8x NVIDIA H100" and h100.fleet == 3
    assert h100.fleet_median == 150.0
    assert report.metrics[next(iter(report.metrics))]["h100-a"] == 1.0  # its type's median
    md = aggregate_report.markdown(report)
    assert "| h100-c | h100-x8, 8x NVIDIA H100 | " in md


def test_a_node_alone_of_its_type_is_compared_with_none(tmp_path):
    node(tmp_path, "h200-a", 300.0)
    node(tmp_path, "h200-b", 305.0)
    node(tmp_path, "small", 20.0, profile="auto-h200-x1", count=1)
    assert outliers(tmp_path) == set()


def test_one_off_costs_and_latencies_are_not_outliers(tmp_path):
    """The node whose op cache was cold built fused_adam (38.3 s, 238x the others' warm load,
    tests/data/reference-runs run A); 1 MiB collectives take 35-90 us, run to run."""
    node(tmp_path, "cold", 300.0, op_load(38.3), latency(80e-6))
    node(tmp_path, "warm1", 300.0, op_load(0.16), latency(40e-6))
    node(tmp_path, "warm2", 300.0, op_load(0.17), latency(41e-6))
    assert outliers(tmp_path) == set()
    # The same node slower on a metric that is judged is an outlier.
    node(tmp_path, "slow", 200.0, op_load(0.16), latency(40e-6))
    assert outliers(tmp_path) == {("slow", "all_reduce.busbw")}
