"""Benchmark records: measured values and test outcomes in pytest-benchmark's JSON format.

Each metric becomes one entry of ``benchmarks`` with ``stats`` computed from its samples (so
``pytest-benchmark compare`` reads the file) and ``extra_info`` carrying what a comparison needs
and pytest-benchmark does not know: metric name, unit, which direction is better, the limit the
suite enforced, and the parameters. Bandwidths are GB/s with GB = 1e9 bytes; times are seconds.
``dsconform`` at top level carries every test's outcome so a comparison can say "passed on
0.19.6, skipped (unavailable) on 0.19.8".
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

FORMAT = "dsconform-records/1"
BETTER = ("lower", "higher")
USER_PROPERTY = "dsconform_metric"  # key in pytest's user_properties (travels under xdist)


@dataclass
class Metric:
    nodeid: str
    name: str  # e.g. "max_rel_loss_diff", "build_seconds", "write_gbps"
    samples: list[float]
    unit: str  # "s", "GB/s", "ratio", ...
    better: str  # "lower" | "higher"
    limit: float | None = None  # the floor (better=higher) or ceiling (better=lower) enforced
    params: dict[str, Any] = field(default_factory=dict)
    capability: str = ""

    def __post_init__(self) -> None:
        if self.better not in BETTER:
            raise ValueError(f"metric {self.name}: better must be one of {BETTER}, "
                             f"not {self.better!r}")
        if not self.samples:
            raise ValueError(f"metric {self.name}: no samples")
        self.samples = [float(s) for s in self.samples]


def stats(samples: Sequence[float]) -> dict[str, Any]:
    """pytest-benchmark's stats block for a list of samples."""
    data = sorted(samples)
    n = len(data)
    mean = statistics.fmean(data)
    if n >= 2:
        q1, median, q3 = statistics.quantiles(data, n=4, method="inclusive")
        stddev = statistics.stdev(data)
    else:
        q1 = median = q3 = data[0]
        stddev = 0.0
    iqr = q3 - q1
    lo, hi = q1 - 1.5 * iqr, q3 + 1.5 * iqr
    inside = [x for x in data if lo <= x <= hi] or data
    return {
        "min": data[0], "max": data[-1], "mean": mean, "stddev": stddev, "rounds": n,
        "median": median, "iqr": iqr, "q1": q1, "q3": q3,
        "iqr_outliers": n - len(inside),
        "stddev_outliers": sum(1 for x in data if abs(x - mean) > stddev) if stddev else 0,
        "outliers": f"{sum(1 for x in data if abs(x - mean) > stddev) if stddev else 0};"
                    f"{n - len(inside)}",
        "ld15iqr": inside[0], "hd15iqr": inside[-1],
        "ops": (1.0 / mean) if mean else 0.0, "total": sum(data), "iterations": 1,
        "data": list(samples),
    }


def benchmark_entry(m: Metric) -> dict[str, Any]:
    test = m.nodeid.split("::", 1)[-1]
    return {
        "group": m.capability or None,
        "name": f"{test}::{m.name}",
        "fullname": f"{m.nodeid}::{m.name}",
        "params": m.params or None,
        "param": None,
        "extra_info": {"metric": m.name, "unit": m.unit, "better": m.better, "limit": m.limit,
                       "params": m.params, "nodeid": m.nodeid},
        "options": {"min_rounds": len(m.samples), "timer": "dsconform", "disable_gc": False,
                    "warmup": False},
        "stats": stats(m.samples),
    }


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed | failed | skipped | error | xfailed | xpassed
    capability: str
    reason: str = ""  # skip reason or the failure's first line
    duration_s: float = 0.0
    must: str = ""  # the test's one-line MUST statement (first docstring line)


def document(metrics: Iterable[Metric], outcomes: Iterable[Outcome], *,
             machine_info: Mapping[str, Any], commit_info: Mapping[str, Any],
             profile: Mapping[str, Any], extra_benchmarks: Iterable[Mapping] = (),
             started: str | None = None) -> dict[str, Any]:
    try:
        import pytest_benchmark
        pb_version = pytest_benchmark.__version__
    except ImportError:
        pb_version = "unknown"
    now = _dt.datetime.now(_dt.timezone.utc).isoformat()
    return {
        "machine_info": dict(machine_info),
        "commit_info": dict(commit_info),
        "benchmarks": [benchmark_entry(m) for m in metrics] + list(extra_benchmarks),
        "datetime": now,
        "version": pb_version,
        "dsconform": {
            "format": FORMAT,
            "profile": dict(profile),
            "started": started,
            "finished": now,
            "outcomes": [asdict(o) for o in outcomes],
        },
    }
