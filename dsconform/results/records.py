"""Benchmark records: measured values and test outcomes in pytest-benchmark's JSON format.

Each metric becomes one entry of ``benchmarks`` with ``stats`` computed from its samples (so
``pytest-benchmark compare`` reads the file) and ``extra_info`` carrying what a comparison needs
and pytest-benchmark does not know: metric name, unit, which direction is better, the limit the
suite enforced, and the parameters. Bandwidths are GB/s with GB = 1e9 bytes; times are seconds.
``dsconform`` at top level carries every test's outcome so a comparison can say "passed on
0.19.6, skipped (unavailable) on 0.19.8", and the facts tests recorded (non-numeric observations
such as DeepSpeed's effective defaults) so it can say what silently changed.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "dsconform-records/1"
BETTER = ("lower", "higher")
USER_PROPERTY = "dsconform_metric"  # key in pytest's user_properties (travels under xdist)
FACT_PROPERTY = "dsconform_fact"  # the same, for facts
#: The same channel for what the outcome needs from the collected item (its capability, MUST
#: statement and known issue): an xdist controller never sees the items. On the setup and call
#: reports only, so JUnit's properties (taken from the teardown report) stay the test's own.
CASE_PROPERTY = "dsconform_case"
#: A batched cell's call seconds, as a test's user property (junit.xml) and journal field
#: (``batch_seconds``): what the cell's own call took, which its test only waited for.
BATCH_SECONDS = "dsconform_batch_seconds"
#: Units of performance values (times and rates). A performance value held to a limit carries
#: at least MIN_ROUNDS samples, so a comparison can see its noise and a floor is not decided by
#: one unlucky round.
PERFORMANCE_UNITS = ("s", "ms", "GB/s", "TFLOPS", "steps/s", "samples/s")
MIN_ROUNDS = 3


@dataclass
class Rate:
    """A rate derived from a timed metric: ``amount / scale / seconds`` per round, e.g. bytes
    over 1e9 for GB/s. The timed seconds stay the metric's samples (what pytest-benchmark reads
    as a time); the rate, its direction (higher is better) and its floor live here."""
    unit: str      # "GB/s", "TFLOPS", ...
    amount: float  # what one round moved or computed: bytes, flops
    scale: float   # 1e9 for GB/s (GB = 1e9 bytes), 1e12 for TFLOPS
    limit: float | None = None  # floor on the median rate

    def of(self, seconds: float) -> float:
        """The rate of one round; NaN where the round's time is not a positive finite number
        (a broken timer must not read as an infinitely fast round)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return float("nan")
        return self.amount / self.scale / seconds


@dataclass
class Metric:
    nodeid: str
    name: str  # e.g. "max_rel_loss_diff", "build_seconds", "all_reduce.busbw"
    samples: list[float]
    unit: str  # "s", "1", "ratio", ...
    better: str  # "lower" | "higher"
    limit: float | None = None  # the floor (better=higher) or ceiling (better=lower) enforced
    params: dict[str, Any] = field(default_factory=dict)
    capability: str = ""
    rate: Rate | None = None  # for timed metrics: the rate derived from each round
    # The tolerance the suite's own check holds this value to (a ZeRO difference's rtol, a
    # gain's bound): not enforced here (the check fails with its own message); a comparison
    # judges a change of the value against it, not against a share of the value itself.
    bound: float | None = None

    def __post_init__(self) -> None:
        if self.better not in BETTER:
            raise ValueError(f"metric {self.name}: better must be one of {BETTER}, "
                             f"not {self.better!r}")
        if not self.samples:
            raise ValueError(f"metric {self.name}: no samples")
        self.samples = [float(s) for s in self.samples]
        if isinstance(self.rate, dict):  # from JSON (xdist user_properties, records.jsonl)
            self.rate = Rate(**self.rate)
        if self.rate is not None and self.unit != "s":
            raise ValueError(f"metric {self.name}: a rate derives from seconds, unit is "
                             f"{self.unit!r}")

    @property
    def value(self) -> float:
        """The median of the rounds."""
        return statistics.median(self.samples)

    @property
    def rate_samples(self) -> list[float]:
        return [self.rate.of(s) for s in self.samples] if self.rate else []

    def limit_violation(self) -> str | None:
        """One line naming metric, value, limit and parameters when the median is on the wrong
        side of the limit (a floor for better="higher" and for rates, a ceiling for
        better="lower")."""
        params = ", ".join(f"{k}={val}" for k, val in self.params.items())
        where = f" [{params}]" if params else ""
        if self.rate is not None and self.rate.limit is not None:
            rates = self.rate_samples
            broken = [s for s in self.samples if not (math.isfinite(s) and s > 0)]
            if broken:
                return (f"{self.name}: {len(broken)} of {len(self.samples)} rounds took "
                        f"{', '.join(repr(s) for s in broken)} s, not a positive finite time: "
                        f"no rate to hold to its floor {self.rate.limit:.4g} "
                        f"{self.rate.unit}{where}")
            v = statistics.median(rates)
            if v >= self.rate.limit:
                return None
            return (f"{self.name} = {v:.4g} {self.rate.unit}{_rounds(rates)} is below its floor "
                    f"{self.rate.limit:.4g} {self.rate.unit}{where}")
        if self.limit is None:
            return None
        v = self.value
        # NaN is never within a limit (a plain comparison with NaN is False both ways).
        bad = not v >= self.limit if self.better == "higher" else not v <= self.limit
        if not bad:
            return None
        kind = "floor" if self.better == "higher" else "ceiling"
        return (f"{self.name} = {v:.4g} {self.unit}{_rounds(self.samples)} is beyond its {kind} "
                f"{self.limit:.4g} {self.unit}{where}")


def _rounds(samples: Sequence[float]) -> str:
    if len(samples) < 2:
        return ""
    return f" (median of {len(samples)} rounds: {', '.join(f'{x:.4g}' for x in samples)})"


class MetricsRecorder:
    """Records one test's measured values into the run's benchmark JSON, and holds them to
    their limits: the ONE place a floor or ceiling is enforced.

    ``record`` keeps every value (a value beyond its limit is recorded too, so the results show
    it); the plugin fails the test after its body returns if any recorded value broke its limit,
    listing all of them. ``check()`` does the same at once, for a suite that must stop early.
    """

    def __init__(self, nodeid: str, capability: str, sink: Callable[[Metric], None]):
        self.nodeid = nodeid
        self.capability = capability
        self._sink = sink
        self.recorded: list[Metric] = []

    def record(self, name: str, value: float | Sequence[float], *, unit: str, better: str,
               limit: float | None = None, bound: float | None = None,
               **params: Any) -> Metric:
        """Record ``value`` (one number, or one per round). ``better`` is "lower" or "higher";
        ``limit`` is a floor (higher is better) or a ceiling (lower is better) on the median;
        ``bound`` the tolerance the test's own check holds the value to (not enforced here)."""
        samples = list(value) if isinstance(value, (list, tuple)) else [value]
        m = Metric(self.nodeid, name, samples, unit, better, limit, params, self.capability,
                   bound=None if bound is None else float(bound))
        if limit is not None and unit in PERFORMANCE_UNITS:
            self._need_rounds(m)
        return self._keep(m)

    def record_rate(self, name: str, seconds: Sequence[float], *, amount: float, unit: str,
                    scale: float, floor: float | None = None, **params: Any) -> Metric:
        """Record a timed operation, one time per round, and the rate derived from it:
        ``amount / scale / seconds`` in ``unit`` (bytes, 1e9, "GB/s"). The times are the
        benchmark's stats (lower is better); the rate and its ``floor`` (on the median rate)
        go to extra_info. A floor needs at least MIN_ROUNDS rounds."""
        rate = Rate(unit=unit, amount=float(amount), scale=float(scale),
                    limit=None if floor is None else float(floor))
        m = Metric(self.nodeid, name, list(seconds), "s", "lower", None,
                   {**params, "amount": amount}, self.capability, rate)
        if floor is not None:
            self._need_rounds(m)
        return self._keep(m)

    @staticmethod
    def _need_rounds(m: Metric) -> None:
        if len(m.samples) < MIN_ROUNDS:
            raise ValueError(f"metric {m.name}: a performance value held to a limit needs at "
                             f"least {MIN_ROUNDS} rounds, got {len(m.samples)}")

    def _keep(self, m: Metric) -> Metric:
        self.recorded.append(m)
        self._sink(m)
        return m

    def violations(self) -> list[str]:
        return [v for v in (m.limit_violation() for m in self.recorded) if v]

    def check(self) -> None:
        """Raise AssertionError listing every recorded value beyond its limit."""
        found = self.violations()
        if found:
            raise AssertionError("; ".join(found))


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
        "extra_info": _extra_info(m),
        "options": {"min_rounds": len(m.samples), "timer": "dsconform", "disable_gc": False,
                    "warmup": False},
        "stats": stats(m.samples),
    }


def _extra_info(m: Metric) -> dict[str, Any]:
    info = {"metric": m.name, "unit": m.unit, "better": m.better, "limit": m.limit,
            "params": m.params, "nodeid": m.nodeid}
    if m.bound is not None:
        info["bound"] = m.bound
    if m.rate is not None:
        rates = m.rate_samples
        info["rate"] = {"unit": m.rate.unit, "better": "higher", "limit": m.rate.limit,
                        "amount": m.rate.amount, "scale": m.rate.scale,
                        "median": statistics.median(rates), "samples": rates,
                        "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0}
    return info


@dataclass
class Fact:
    """A non-numeric observation a test records so that two runs can be compared: an effective
    DeepSpeed default, the class an optimizer type builds. Not a check: the test asserts what
    must hold; the fact says what was found, and `dsconform compare` names the ones that
    changed between two runs ("what silently changed")."""
    nodeid: str
    name: str  # e.g. "default.gradient_clipping"
    value: Any  # JSON: str, number, bool, None, and lists/dicts of them
    capability: str = ""


def _as_json(name: str, value: Any) -> Any:
    """``value`` as JSON will hold it (tuples become lists), so a fact read back from a results
    file compares equal to the one recorded. Objects without a JSON form (a torch.dtype) are
    kept as their ``str``; a value JSON cannot hold at all is an error naming the fact."""
    try:
        return json.loads(json.dumps(value, default=str, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"fact {name}: value {value!r} cannot be recorded as JSON: {e}") from None


class FactsRecorder:
    """Records one test's facts into the run's benchmark JSON (``dsconform.facts``)."""

    def __init__(self, nodeid: str, capability: str, sink: Callable[[Fact], None]):
        self.nodeid = nodeid
        self.capability = capability
        self._sink = sink
        self.recorded: list[Fact] = []

    def record(self, name: str, value: Any) -> Fact:
        """Record that ``name`` was found to be ``value`` (JSON-representable)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"fact name must be a non-empty string, not {name!r}")
        f = Fact(self.nodeid, name, _as_json(name, value), self.capability)
        self.recorded.append(f)
        self._sink(f)
        return f


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed | failed | skipped | error | xfailed | xpassed
    capability: str
    reason: str = ""  # skip reason or the failure's first line
    duration_s: float = 0.0
    must: str = ""  # the test's one-line MUST statement (first docstring line)
    known_issue: str = ""  # id of the known upstream issue that made this case a strict xfail


def document(metrics: Iterable[Metric], outcomes: Iterable[Outcome], *,
             machine_info: Mapping[str, Any], commit_info: Mapping[str, Any],
             profile: Mapping[str, Any], extra_benchmarks: Iterable[Mapping] = (),
             started: str | None = None,
             known_issues: Iterable[Mapping[str, Any]] = (),
             facts: Iterable[Fact] = ()) -> dict[str, Any]:
    try:
        import pytest_benchmark
        pb_version = pytest_benchmark.__version__
    except ImportError:
        pb_version = "unknown"
    now = _dt.datetime.now(_dt.UTC).isoformat()
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
            "known_issues": list(known_issues),
            "facts": [asdict(f) for f in facts],
        },
    }
