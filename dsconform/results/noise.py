"""When a metric's change between two runs is noise: the rules ``dsconform compare`` judges a
metric by, and the one table of their thresholds, each with its reason.

A metric whose NEW value is beyond the limit its test enforced, or a value judged by the
tolerance its test holds it to (``extra_info.bound``), is judged by that limit or bound
(dsconform/results/compare.py) before any of this. Every other metric:

1. **Not judged, only reported:** one-off costs (an op's build or load, a first call, a
   start-up: ``ONE_OFF``); timings whose rounds are shorter than ``MIN_SECONDS``, and shares of
   such a timing (a rank's wait in a 40 us collective); and timings with fewer than
   ``MIN_ROUNDS`` rounds in either run (their noise was never measured).
2. **Judged from the rounds:** each run's noise is the robust spread of its rounds (1.4826 x
   their median absolute deviation: a standard deviation for normal noise, which one wild
   round of three cannot widen). The change of the medians counts only when it exceeds
   ``NOISE_SPREADS`` times the pooled spread of both runs, AND the minimum relative change
   (the ``--threshold``, default 10%, or the wider minimum ``MIN_CHANGE`` sets for a family),
   AND, for a share of time (unit ``%``), ``PERCENT_POINTS``.
3. **Values measured once that are not timings** (a loss, a byte count, a difference without a
   bound: deterministic on one stack) have no noise to measure: any change beyond the minimum
   relative change counts, and the report says the noise is unknown (a low-precision
   gradient's worst difference moves by units in the last place: ``MIN_CHANGE``).

The evidence the reasons cite, three runs of one unchanged 2xH200 stack (two warm, one with a
cold op cache), is in tests/data/reference-runs/ (its README says what they are).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dsconform.results.records import MIN_ROUNDS, PERFORMANCE_UNITS

EVIDENCE = "runs of one unchanged 2xH200 stack (tests/data/reference-runs)"


@dataclass(frozen=True)
class Rule:
    value: float
    why: str


#: How far beyond the pooled spread a change must go.
NOISE_SPREADS = Rule(3.0, "three standard deviations: with 3 rounds a run's median is itself "
                          "uncertain by about one spread, so a change of three is not chance")
#: A timed round shorter than this is latency, not throughput.
MIN_SECONDS = Rule(1e-4, "below 100 us per call, launch jitter dominates (the collectives suite "
                         "holds rank waits only above it: MIN_WAIT_CHECK_SECONDS, "
                         "dsconform/node/gpu_health.py): 1 MiB collectives (35-90 us) moved by "
                         f"40-90% with tight rounds between {EVIDENCE}")
#: A value in percent (a share of time) that moved by fewer points than this is unchanged.
PERCENT_POINTS = Rule(1.0, "under 1 point of the whole, a share of time (a rank's wait: "
                           "0.0017% -> 0.11%) is no slowdown to act on; waits at 64 MiB and up "
                           f"moved by up to 0.2 points between {EVIDENCE}")
#: Metric families whose runs move more than the default threshold between runs of one node,
#: with rounds that are tight within each run: their minimum relative change.
MIN_CHANGE = {
    "checkpoint.": Rule(0.35, "a checkpoint's save and load go through the page cache to a "
                              "virtio disk: checkpoint.load moved 1.10 <-> 1.42 GB/s (29%) with "
                              f"rounds within 3% between warm {EVIDENCE}; its floor still holds "
                              "it"),
    "nvme.": Rule(0.35, "DeepNVMe and dd throughput on the same disk moved by up to 30% (1.64 "
                        f"<-> 2.13 GB/s) between {EVIDENCE}; the floors still hold it"),
    **dict.fromkeys(("zero.grad_max_abs_diff", "zero_infinity.grad_max_abs_diff"), Rule(
        1.0, "the worst element of a bf16 or fp16 gradient differs from DDP's by whole units in "
             "the last place, and which element is worst follows the GPU's reduction order: "
             "0.00146 <-> 0.00195 (+33%) and 0.00111 <-> 0.00140 (+26%) between two warm runs "
             "of one unchanged 1xH100 stack (tests/data/reference-runs: h100-x1-W1, -W2); a "
             "broken reduction moves it by orders of magnitude, and the test's tolerance "
             "fails it")),
}
#: Why a timing of ranks on DeepSpeed's CPU accelerator is reported, never judged.
CPU_ACCELERATOR_WHY = ("measured on the CPU accelerator, whose ranks share the machine's cores "
                       "with every other process: a CPU all_reduce moved 2x between two runs "
                       "of one CPU machine with rounds within 10% (tests/data/reference-runs: "
                       "cpu-p, cpu-q); no profile holds it to a floor")
#: The last part of a metric's name that marks a one-off cost.
ONE_OFF = ("build_seconds", "load_seconds", "first_call_seconds", "startup_seconds")
ONE_OFF_WHY = ("one-off cost (an op's build or load, a first call, a start-up): a cold cache "
               "makes it seconds, not milliseconds")


def is_one_off(metric: str) -> bool:
    return metric.rsplit(".", 1)[-1] in ONE_OFF


def is_timing(unit: str) -> bool:
    """A time or a rate derived from one: its noise must be measured to judge it."""
    return unit in PERFORMANCE_UNITS


def spread(samples: Sequence[float]) -> float | None:
    """A run's noise in the metric's own unit: 1.4826 x the median absolute deviation of its
    rounds; None with fewer than MIN_ROUNDS rounds, or rounds that diverged (unknown)."""
    values = [float(v) for v in samples]
    if len(values) < MIN_ROUNDS or not all(math.isfinite(v) for v in values):
        return None
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)


def pooled(a: float | None, b: float | None) -> float | None:
    """Both runs' spreads as one (the root mean square); None where either is unknown."""
    if a is None or b is None:
        return None
    return math.sqrt((a * a + b * b) / 2)


def min_change(metric: str, threshold: float) -> float:
    """The smallest relative change that counts for ``metric``: the threshold, or its family's
    wider minimum."""
    wider = [r.value for prefix, r in MIN_CHANGE.items() if metric.startswith(prefix)]
    return max([threshold, *wider])


def not_judged(metric: str, unit: str, seconds: float | None, rounds: int,
               accelerator: str | None = None) -> str | None:
    """Why a metric's change is reported but not judged, or None when it is judged.

    ``seconds``: the median time of one round where the metric is a time, a rate or a share of
    a time (else None), the shorter of the two runs'; ``rounds``: the fewer of the two runs';
    ``accelerator``: the ranks' accelerator where the test names one ("cpu", "cuda")."""
    if is_one_off(metric):
        return ONE_OFF_WHY
    if accelerator == "cpu" and (is_timing(unit) or unit == "%"):
        return CPU_ACCELERATOR_WHY
    if seconds is not None and seconds < MIN_SECONDS.value:
        what = "a share of a timing" if unit == "%" else "a timing"
        return (f"{what} of {seconds * 1e6:.3g} us per round, under {MIN_SECONDS.value * 1e6:g} "
                "us: latency, not throughput")
    if is_timing(unit) and rounds < MIN_ROUNDS:
        return (f"noise unknown: {rounds} round{'s' if rounds != 1 else ''} (a timing is judged "
                f"from {MIN_ROUNDS})")
    return None


def rules() -> dict[str, dict[str, object]]:
    """Every threshold with its reason, for the comparison's JSON."""
    table: dict[str, Rule] = {"noise_spreads": NOISE_SPREADS, "min_seconds": MIN_SECONDS,
                              "percent_points": PERCENT_POINTS,
                              **{f"min_change[{p}*]": r for p, r in MIN_CHANGE.items()}}
    out: dict[str, dict[str, object]] = {k: {"value": r.value, "why": r.why}
                                         for k, r in table.items()}
    out["min_rounds"] = {"value": MIN_ROUNDS, "why": "fewer rounds cannot show a timing's noise"}
    out["one_off"] = {"value": list(ONE_OFF), "why": ONE_OFF_WHY}
    out["cpu_accelerator"] = {"value": "cpu", "why": CPU_ACCELERATOR_WHY}
    return out


def floor(unit: str) -> float:
    """The smallest absolute change that counts, in the metric's unit (0: none)."""
    return PERCENT_POINTS.value if unit == "%" else 0.0
