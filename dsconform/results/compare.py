"""Compare two runs' benchmark JSON: before and after a DeepSpeed upgrade, or two nodes.

What a user needs around an upgrade, at a glance: what stopped working, what got slower (or
drifted), what silently changed, and what was fixed upstream. This module reads two results
files and classifies every difference; ``compare_report`` prints it (terminal, markdown) and
``compare_plot`` draws it.

- **Matching.** Tests are matched by a stable id: the conformance id that leads the test's MUST
  line (``ZERO-EQ-1: ...``, recorded as the outcome's ``must``) plus its parametrization id, e.g.
  ``ZERO-EQ-1[cuda-z3-off_none-bf16-sgd-gas1-ws2]``. Renaming a test function or moving it to
  another file does not break a comparison. A test without such an id, or whose id is not unique
  in its run, is matched by its node id. Metrics and facts follow their test's id.
- **Metrics** are direction-aware (``extra_info.better``: seconds up is worse) and judged
  against the noise both runs measured in their rounds (dsconform/results/noise.py: the rules
  and their thresholds): a change counts only beyond ``NOISE_SPREADS`` times the pooled robust
  spread of both runs' rounds AND beyond the minimum relative change (``threshold``, or a
  family's wider one); a share of time must also move by a point. One-off costs (op builds and
  loads), timings shorter than 100 us and timings of fewer than 3 rounds are reported as *not
  judged*. A value measured once that is not a timing has unknown noise: only the threshold
  applies, and the report says so.
  A value past the limit the suite enforced is a regression however small. Timed metrics
  recorded with ``record_rate`` hold seconds in ``stats`` and the rate in ``extra_info.rate``:
  they are compared as rates (higher is better, the floor on the median rate, noise from the
  rate samples). Older files held GB/s directly in ``stats``; both are read, and an old GB/s
  metric compares with a new rate of the same unit.
- **Bounded values** (a ZeRO difference, a loss-scaling gain: ``extra_info.bound``, the
  tolerance the suite's own check holds the value to) are judged against that bound, not
  against a share of their own value: a difference that grows from 4.4e-4 to 5.3e-4 under an
  rtol of 1.6e-2 is unchanged. It is a regression when it crosses its bound, or when it passes
  ``BOUND_APPROACH`` of it from below; back within its bound is an improvement. Files written
  before bounds were recorded carry the tolerance in the parameters (``LEGACY_BOUNDS``).
- **Outcomes.** passed -> failed / error / skipped / xfailed / not run is a regression (it
  stopped working); failed / skipped / xfailed -> passed an improvement (fixed, or runs now).
  New and vanished tests are listed.
- **Known upstream issues** (``dsconform/gate/known_issues.py``) that appeared or went away, and
  what became of their cases.
- **Facts** (``dsconform.facts``: DeepSpeed's effective defaults as the ZeRO suite finds them,
  the GPUs' health snapshots) whose value changed: "what silently changed". Listed, never a
  regression by themselves; a long value on one line by what changed in it
  (dsconform/results/fact_changes.py).
- **Environment**: DeepSpeed, torch, CUDA, NCCL, driver, GPU, profile. Runs of different profiles
  or GPUs are compared with a loud warning (the difference may be the machine).

Exit codes (CLI): 0 no regression, 1 regression found, 2 unreadable input (and, with --strict,
runs of different profiles or GPUs).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from dsconform.results import noise
from dsconform.results.changes import (
    CHANGED,
    IMPROVEMENT,
    KNOWN_ISSUE,
    METRIC,
    NEW,
    NOT_COMPARABLE,
    NOT_JUDGED,
    OUTCOME,
    REGRESSION,
    RENAMED,
    UNCHANGED,
    VANISHED,
    Change,
)
from dsconform.results.changes import (
    FACT as FACT,  # callers read every kind and area here
)
from dsconform.results.fact_changes import compare_facts as fact_changes
from dsconform.results.format import is_number
from dsconform.results.summary import case_id

#: A bounded value past this share of its bound is a regression (it "approaches" the bound)
#: when BASE was below it: one more drift like the largest seen between two releases inside a
#: bound (+21%, 1xH200 0.19.6 -> 0.19.8, results/reference/h200-x1/upgrade-0.19.6-to-0.19.8)
#: would take it over (0.8 x 1.21 = 0.97 of the bound).
BOUND_APPROACH = 0.8
#: Metrics recorded before ``extra_info.bound`` existed, and the parameter that held their
#: bound: the loss's relative difference is held to the tolerance's rtol.
LEGACY_BOUNDS = {"zero.loss_max_rel_diff": "rtol", "zero_infinity.loss_max_rel_diff": "rtol",
                 "zero.clip_norm_rel_diff": "rtol"}
#: "ZERO-EQ-1: ZeRO MUST ..." -> "ZERO-EQ-1" (upper case words joined by dashes, then a colon)
CONFORMANCE_ID = re.compile(r"^([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+):")
#: Environment rows: label and machine_info key ("GPU" and "profile" are composed).
ENVIRONMENT = (("DeepSpeed", "deepspeed"), ("torch", "torch"), ("CUDA", "cuda"),
               ("NCCL", "nccl"), ("driver", "driver"), ("GPU", None), ("profile", None),
               ("python", "python_version"), ("node", "node"))
# What must match for two runs to be of the same hardware.
HARDWARE = ("profile", "GPU")

# ------------------------------------------------------------------ one run, normalised

def conformance_id(must: str) -> str | None:
    """The stable conformance id leading a MUST line ("ZERO-EQ-1: ..."), else None."""
    m = CONFORMANCE_ID.match(must or "")
    return m.group(1) if m else None


def stable_id(nodeid: str, must: str) -> str:
    """``ZERO-EQ-1[cuda-z3-...]`` for a test whose MUST line carries a conformance id, else the
    node id."""
    cid = conformance_id(must)
    if cid is None:
        return nodeid
    case = case_id(nodeid)
    return f"{cid}[{case}]" if case else cid


@dataclass(frozen=True)
class Measure:
    """One metric of one run, as compared: a rate's value is the rate, not the seconds."""
    nodeid: str
    metric: str
    value: float  # the median
    rounds: int
    spread: float | None  # the rounds' robust spread in ``unit`` (noise.spread); None: unknown
    unit: str
    better: str  # "lower" | "higher"
    limit: float | None  # the floor (higher is better) or ceiling (lower) the suite enforced
    params: dict[str, Any]
    bound: float | None = None  # the tolerance the suite's check holds the value to
    # The median time of one round, where the value is a time, a rate or a share of a time
    # (``read_run`` finds a share's timing); None for other values.
    seconds: float | None = None


def _spread(samples: list[float], stddev: Any, rounds: int) -> float | None:
    if samples:
        return noise.spread(samples)
    # A file that kept pytest-benchmark's statistics but not the samples.
    ok = rounds >= noise.MIN_ROUNDS and is_number(stddev) and math.isfinite(stddev)
    return float(stddev) if ok else None


def measure(entry: dict[str, Any]) -> Measure:
    """A benchmark entry (checked by ``check``) as compared."""
    info = entry.get("extra_info") or {}
    nodeid = info.get("nodeid")
    metric = info.get("metric")
    if nodeid is None or metric is None:
        # A plain pytest-benchmark entry: its full name is the test, it measured a time.
        nodeid, metric = entry["fullname"], "time"
    params = dict(info.get("params") or entry.get("params") or {})
    st = entry["stats"]
    rate = info.get("rate")
    if rate is not None:
        samples = list(rate["samples"])
        # The rate is normalised by the amount; what was measured is in the other parameters
        # (bytes, world size), as in files written before rates existed.
        params.pop("amount", None)
        return Measure(nodeid, metric, float(rate["median"]), len(samples),
                       _spread(samples, rate.get("stddev"), len(samples)), rate["unit"],
                       "higher", rate.get("limit"), params, seconds=float(st["median"]))
    data = list(st.get("data") or [])
    rounds = st.get("rounds") or len(data) or 1
    bound = info.get("bound")
    if bound is None and metric in LEGACY_BOUNDS and is_number(params.get(LEGACY_BOUNDS[metric])):
        bound = params[LEGACY_BOUNDS[metric]]
    unit = info.get("unit") or "s"
    scale = {"s": 1.0, "ms": 1e-3}.get(unit)
    return Measure(nodeid, metric, float(st["median"]), rounds,
                   _spread(data, st.get("stddev"), rounds), unit,
                   info.get("better") or "lower", info.get("limit"), params,
                   None if bound is None else float(bound),
                   None if scale is None else float(st["median"]) * scale)


def _params_key(m: Measure) -> tuple[str, str]:
    return m.nodeid, json.dumps(m.params, sort_keys=True, default=str)


def _shares_of_time(measures: dict[str, Measure]) -> None:
    """A value in percent that a test recorded beside a timing of the same parameters (a rank's
    wait beside its time in the call) is a share of that timing: it takes its seconds, so a
    share of a call too short to judge is not judged either."""
    timed = {_params_key(m): m.seconds for m in measures.values() if m.seconds is not None}
    for key, m in measures.items():
        if m.unit == "%" and m.seconds is None and _params_key(m) in timed:
            measures[key] = replace(m, seconds=timed[_params_key(m)])


@dataclass
class Run:
    """One results file, keyed by stable ids."""
    label: str
    env: dict[str, str]
    outcomes: dict[str, dict[str, Any]]  # stable id -> outcome
    measures: dict[str, Measure]  # "stable id::metric" -> measure
    facts: dict[str, Any]  # "stable id::fact" -> value
    has_facts: bool
    known_issues: dict[str, dict[str, Any]]  # issue id -> {title, link, deepspeed}


def environment(doc: dict[str, Any]) -> dict[str, str]:
    mi = doc.get("machine_info") or {}
    ds = doc.get("dsconform") or {}
    env = {}
    for label, key in ENVIRONMENT:
        if key is not None:
            env[label] = str(mi.get(key) or "-")
    model, count = mi.get("gpu_model"), mi.get("gpu_count")
    env["GPU"] = f"{count}x {model}" if model and count else "none"
    env["profile"] = str(mi.get("profile") or (ds.get("profile") or {}).get("name") or "-")
    return {label: env[label] for label, _ in ENVIRONMENT}


def read_run(doc: dict[str, Any], label: str = "") -> Run:
    ds = doc.get("dsconform") or {}
    outcomes = ds.get("outcomes") or []
    keys = {o["nodeid"]: stable_id(o["nodeid"], o.get("must") or "") for o in outcomes}
    # An id two tests share would match the wrong test: both fall back to their node ids.
    taken = Counter(keys.values())
    keys = {n: (k if taken[k] == 1 else n) for n, k in keys.items()}
    run = Run(label, environment(doc), {keys[o["nodeid"]]: o for o in outcomes}, {}, {},
              "facts" in ds, {ki["id"]: ki for ki in ds.get("known_issues") or []})
    for entry in doc["benchmarks"]:
        m = measure(entry)
        key = _unique(run.measures, f"{keys.get(m.nodeid, m.nodeid)}::{m.metric}")
        run.measures[key] = m
    _shares_of_time(run.measures)
    for f in ds.get("facts") or []:
        key = _unique(run.facts, f"{keys.get(f['nodeid'], f['nodeid'])}::{f['name']}")
        run.facts[key] = f.get("value")
    return run


def _unique(taken: dict[str, Any], key: str) -> str:
    n, out = 1, key
    while out in taken:
        n += 1
        out = f"{key} #{n}"
    return out


# ------------------------------------------------------------------ the comparison

@dataclass
class RunComparison:
    base: Run
    new: Run
    threshold: float
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # different hardware
    notes: list[str] = field(default_factory=list)  # what could not be compared, and why

    def of(self, kind: str, area: str | None = None) -> list[Change]:
        return [c for c in self.changes if c.kind == kind and (area is None or c.area == area)]

    @property
    def regressed(self) -> bool:
        return bool(self.of(REGRESSION))

    @property
    def different_hardware(self) -> bool:
        return bool(self.warnings)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _value(v: float, unit: str) -> str:
    # "1" is the unit of a dimensionless ratio: "3.4e-05", not "3.4e-05 1".
    return _fmt(v) if unit in ("", "1") else f"{_fmt(v)} {unit}"


def _params_diff(b: dict[str, Any], n: dict[str, Any]) -> str:
    keys = sorted(set(b) | set(n))
    return ", ".join(f"{k} {b.get(k, '-')} -> {n.get(k, '-')}" for k in keys
                     if b.get(k, "-") != n.get(k, "-"))


# Parameters that say how a value was judged, not what was measured: a tolerance override in
# one run's profile (or a table entry that moved) must not make a measured difference
# incomparable. They are named in the change's detail when they differ.
JUDGING_PARAMS = ("rtol", "atol")


def _measured(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in JUDGING_PARAMS}


def compare_measure(name: str, base: Measure, new: Measure, threshold: float) -> Change:
    """One metric of both runs: regression, improvement, unchanged or not comparable."""
    if _measured(base.params) != _measured(new.params):
        return Change(NOT_COMPARABLE, name, f"parameters differ: "
                                            f"{_params_diff(base.params, new.params)}")
    judged = ("" if base.params == new.params else
              f"; judged under other bounds: {_params_diff(base.params, new.params)}")
    change = _compare_values(name, base, new, threshold)
    if judged:
        change = replace(change, detail=change.detail + judged)
    return change


def _compare_values(name: str, base: Measure, new: Measure, threshold: float) -> Change:
    if (base.unit, base.better) != (new.unit, new.better):
        return Change(NOT_COMPARABLE, name, f"measured differently: {base.unit} ({base.better} "
                                            f"is better) -> {new.unit} ({new.better} is better)")
    b, n, unit, better = base.value, new.value, new.unit, new.better
    if math.isnan(b) or math.isnan(n):
        return Change(NOT_COMPARABLE, name, f"not a number: {_fmt(b)} -> {_value(n, unit)}")
    if n == b:
        rel, pct = 0.0, "+0.0%"
    elif b == 0 or math.isinf(b) or math.isinf(n):
        # No relative size: bit-exact drifting to 1e-7, or a comparison that diverged (inf).
        rel = math.copysign(math.inf, n - b)
        pct = "from 0" if b == 0 else (f"to {n:g}" if math.isinf(n) else f"from {b:g}")
    else:
        rel = (n - b) / abs(b)
        pct = f"{rel:+.1%}"
    # The noise of both runs, from their own rounds: a noisier NEW widens the band only as far
    # as its rounds' robust spread, which one wild round of three does not move.
    minimum, floor = noise.min_change(new.metric, threshold), noise.floor(unit)
    spread = noise.pooled(base.spread, new.spread)
    margin = None if spread is None else noise.NOISE_SPREADS.value * spread
    band = _relative_band(minimum, max(margin or 0.0, floor), b)
    rounds = min(base.rounds, new.rounds)
    shown = dict(base=_value(b, unit), new=_value(n, unit), rel=rel, band=band,
                 better=better, noise_known=margin is not None, change=pct)
    where = f"{_fmt(b)} -> {_value(n, unit)}"
    limit = new.limit
    if limit is not None and (n < limit if better == "higher" else n > limit):
        beyond = f"beyond its {'floor' if better == 'higher' else 'ceiling'} {_value(limit, unit)}"
        text = _noise(band, margin, minimum, rounds, unit)
        return Change(REGRESSION, name, f"{where}: {beyond} ({pct}, {text})", beyond=beyond,
                      **shown)
    if new.bound is not None and math.isfinite(new.bound):
        return _against_bound(name, b, n, new.bound, where, shown)
    if n == b:
        return Change(UNCHANGED, name, f"{where} ({pct})", **shown)
    seconds = [m.seconds for m in (base, new) if m.seconds is not None]
    why = noise.not_judged(new.metric, unit, min(seconds) if seconds else None, rounds,
                           new.params.get("accelerator"))
    if why is not None:
        return Change(NOT_JUDGED, name, f"{where} ({pct}): not judged: {why}", **shown)
    text = _noise(band, margin, minimum, rounds, unit)
    if abs(n - b) <= floor:
        return Change(UNCHANGED, name, f"{where} ({pct}, within the {floor:g}-point floor of a "
                                       "share)", **shown)
    if abs(rel) <= minimum or (margin is not None and abs(n - b) <= margin):
        return Change(UNCHANGED, name, f"{where} ({pct}, within {text})", **shown)
    worse = rel > 0 if better == "lower" else rel < 0
    return Change(REGRESSION if worse else IMPROVEMENT, name,
                  f"{where} ({pct}, {better} is better; {text})", **shown)


def _relative_band(minimum: float, margin: float, b: float) -> float:
    """The change a metric may make before it counts, relative to BASE (the chart's band):
    ``margin`` is the absolute one (the noise, or the floor of a share)."""
    if b == 0 or not math.isfinite(b):  # no relative size: any margin spans every change
        return math.inf if margin > 0 else minimum
    return max(minimum, margin / abs(b))


def _noise(band: float, margin: float | None, minimum: float, rounds: int, unit: str) -> str:
    if margin is None:
        return (f"noise unknown: {rounds} round{'s' if rounds != 1 else ''}; threshold "
                f"±{minimum:.1%}")
    if math.isinf(band):
        return f"noise band ±{_value(margin, unit)}"
    return f"noise band ±{band:.1%}"


def _used(v: float, bound: float, better: str) -> float:
    """How much of its bound a value uses: 1 at the bound, above 1 beyond it. A floor (higher
    is better) is used up as the value falls to it."""
    if better == "higher":
        return bound / v if v > 0 else math.inf
    if bound == 0:  # bit-exact: any difference is beyond it
        return 0.0 if v <= 0 else math.inf
    return v / bound


def _against_bound(name: str, b: float, n: float, bound: float, where: str,
                   shown: dict[str, Any]) -> Change:
    """A bounded value's change, judged by its bound (``BOUND_APPROACH``): regression when it
    crosses it or passes the approach margin from below, improvement when it comes back within
    it, else unchanged however much it moved relative to itself."""
    better = shown["better"]
    ub, un = _used(b, bound, better), _used(n, bound, better)
    shown = {**shown, "bound": bound, "noise_known": True,
             # the chart's band: how far the value could move before it approaches its bound
             "band": (abs(BOUND_APPROACH * bound - b) / abs(b) if b and math.isfinite(b)
                      else math.inf)}
    side = "floor" if better == "higher" else "bound"
    used = f"{_share(ub)} -> {_share(un)} of its {side} {_fmt(bound)}"
    text = f"{where} ({shown['change']}; {used})"
    if un > 1 and ub <= 1:
        return Change(REGRESSION, name, f"{text}: crossed its {side}",
                      beyond=f"beyond its {side} {_fmt(bound)}", **shown)
    if un > 1:
        return Change(UNCHANGED, name, f"{text}: beyond its {side} in both runs (the test's "
                                       f"outcome says why)", **shown)
    if ub > 1:
        return Change(IMPROVEMENT, name, f"{text}: back within its {side}", **shown)
    if un >= BOUND_APPROACH > ub:
        return Change(REGRESSION, name, f"{text}: approaches its {side} (past "
                                        f"{BOUND_APPROACH:.0%} of it)", **shown)
    return Change(UNCHANGED, name, f"{text}: within its {side}", **shown)


def _share(used: float) -> str:
    return "inf" if math.isinf(used) else f"{used:.1%}"


def _with_reason(o: dict[str, Any]) -> str:
    issue = f" [known issue {o['known_issue']}]" if o.get("known_issue") else ""
    reason = o.get("reason") or ""
    return f"{o['outcome']}{issue}" + (f": {reason}" if reason else "")


FAILING = ("failed", "error")


def classify_outcome(b: str, n: str) -> str:
    """What a change of outcome means for the run under test (NEW)."""
    if b == n:
        return UNCHANGED
    if b == "passed":
        return REGRESSION  # failed, error, skipped, xfailed (broken upstream), xpassed
    if n in FAILING and b not in FAILING:
        # skipped -> failed (a promise now broken), xfailed -> failed (a known issue's range
        # ended, or it fails another way now): NEW fails where BASE did not.
        return REGRESSION
    if n == "passed":
        return IMPROVEMENT  # fixed, fixed upstream, or runs now
    if b == "xfailed" and n == "xpassed":
        return IMPROVEMENT  # the known bug is gone; the registry still claims it
    return CHANGED


def _why_improved(bo: dict[str, Any], no: dict[str, Any]) -> str:
    if bo["outcome"] == "xfailed":
        issue = bo.get("known_issue") or "a known issue"
        if no["outcome"] == "xpassed":
            return (f"fixed upstream: {issue} no longer fails (narrow its entry in "
                    "dsconform/gate/known_issues.py)")
        return f"fixed upstream: {issue} no longer fails"
    return "runs now" if bo["outcome"] == "skipped" else "fixed"


def compare_outcomes(base: Run, new: Run) -> list[Change]:
    out = []
    for key in sorted(set(base.outcomes) | set(new.outcomes)):
        bo, no = base.outcomes.get(key), new.outcomes.get(key)
        if bo is None:
            # A test only NEW has is new; one that fails there is a failure of NEW all the same.
            kind = REGRESSION if no["outcome"] in FAILING else NEW
            detail = _with_reason(no) + (" (a test BASE did not run)" if kind == REGRESSION
                                         else "")
            out.append(Change(kind, key, detail, OUTCOME, new=no["outcome"]))
            continue
        if no is None:
            kind = REGRESSION if bo["outcome"] == "passed" else VANISHED
            out.append(Change(kind, key, f"{bo['outcome']} -> not run: not in NEW's results",
                              OUTCOME, base=bo["outcome"], new="not run"))
            continue
        if bo["nodeid"] != no["nodeid"]:
            out.append(Change(RENAMED, key, f"{bo['nodeid']} -> {no['nodeid']}", OUTCOME))
        b, n = bo["outcome"], no["outcome"]
        kind = classify_outcome(b, n)
        if kind == UNCHANGED and (bo.get("known_issue") or "") != (no.get("known_issue") or ""):
            kind = CHANGED  # xfailed for another known issue
        detail = f"{b} -> {_with_reason(no)}"
        if kind == IMPROVEMENT:
            detail += ": " + _why_improved(bo, no)
        out.append(Change(kind, key, detail, OUTCOME, base=b, new=n))
    return out


def compare_facts(base: Run, new: Run) -> tuple[list[Change], list[str]]:
    if not (base.has_facts and new.has_facts):
        missing = " and ".join(lbl for lbl, r in (("BASE", base), ("NEW", new))
                               if not r.has_facts)
        return [], [f"{missing} recorded no facts (written by an older dsconform): DeepSpeed's "
                    "effective defaults were not compared"]
    empty = [lbl for lbl, r in (("BASE", base), ("NEW", new)) if not r.facts]
    if empty:  # the defaults test (ZERO-DEF-1) was not selected, or did not get that far
        return [], [f"{' and '.join(empty)} recorded no facts (the defaults test ZERO-DEF-1 did "
                    "not run, or ended before recording): DeepSpeed's effective defaults were "
                    "not compared"]
    return fact_changes(base.facts, new.facts), []


def _issue_cases(run: Run) -> dict[str, list[str]]:
    hit: dict[str, list[str]] = {}
    for key, o in run.outcomes.items():
        if o.get("known_issue"):
            hit.setdefault(o["known_issue"], []).append(key)
    for issue_id in run.known_issues:
        hit.setdefault(issue_id, [])
    return hit


def _issue_title(issue_id: str, *runs: Run) -> str:
    for r in runs:
        info = r.known_issues.get(issue_id)
        if info:
            return f"{info.get('title', '')} ({info.get('link', '')})".strip()
    return ""


def compare_known_issues(base: Run, new: Run) -> list[Change]:
    """Known upstream issues that appeared, went away, or cover a different number of cases."""
    out = []
    b_hit, n_hit = _issue_cases(base), _issue_cases(new)
    new_ds, base_ds = new.env["DeepSpeed"], base.env["DeepSpeed"]
    for issue_id in sorted(set(b_hit) | set(n_hit)):
        title = _issue_title(issue_id, new, base)
        bc, nc = b_hit.get(issue_id), n_hit.get(issue_id)
        if bc is None:
            out.append(Change(NEW, issue_id, f"appeared on DeepSpeed {new_ds}: {len(nc)} cases. "
                                             f"{title}", KNOWN_ISSUE, base="-",
                              new=f"{len(nc)} cases"))
        elif nc is None:
            became = Counter(new.outcomes[k]["outcome"] if k in new.outcomes else "not run"
                             for k in bc)
            counts = ", ".join(f"{v} {k}" for k, v in sorted(became.items()))
            if became and set(became) == {"passed"}:
                why = f"fixed upstream: its cases pass on DeepSpeed {new_ds}"
            elif any(k in FAILING for k in became):
                why = (f"no longer registered for DeepSpeed {new_ds} and its cases still fail "
                       "there: verify, then widen the entry in dsconform/gate/known_issues.py")
            else:
                why = f"its cases did not run on DeepSpeed {new_ds}"
            out.append(Change(VANISHED, issue_id, f"went away ({why}; NEW: {counts or 'none'}). "
                                                  f"{title}", KNOWN_ISSUE,
                              base=f"{len(bc)} cases", new="-"))
        elif len(bc) != len(nc):
            out.append(Change(CHANGED, issue_id, f"{len(bc)} cases on DeepSpeed {base_ds} -> "
                                                 f"{len(nc)} on {new_ds}. {title}", KNOWN_ISSUE,
                              base=f"{len(bc)} cases", new=f"{len(nc)} cases"))
    return out


def hardware_warnings(base: Run, new: Run) -> list[str]:
    """One line per hardware fact that differs between the runs (profile, GPU model/count)."""
    return [f"different {label}: BASE {base.env[label]!r}, NEW {new.env[label]!r}"
            for label in HARDWARE if base.env[label] != new.env[label]]


def compare(base: dict[str, Any], new: dict[str, Any], threshold: float = 0.10, *,
            base_label: str = "BASE", new_label: str = "NEW") -> RunComparison:
    """Compare two checked results documents (``load``)."""
    if not (is_number(threshold) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0, not {threshold!r}")
    b, n = read_run(base, base_label), read_run(new, new_label)
    result = RunComparison(b, n, threshold, warnings=hardware_warnings(b, n))
    for key in sorted(set(b.measures) | set(n.measures)):
        if key not in b.measures:
            m = n.measures[key]
            result.changes.append(Change(NEW, key, "not measured in BASE", METRIC,
                                         new=_value(m.value, m.unit)))
        elif key not in n.measures:
            m = b.measures[key]
            result.changes.append(Change(VANISHED, key, "not measured in NEW", METRIC,
                                         base=_value(m.value, m.unit)))
        else:
            result.changes.append(compare_measure(key, b.measures[key], n.measures[key],
                                                  threshold))
    result.changes.extend(compare_outcomes(b, n))
    facts, notes = compare_facts(b, n)
    result.changes.extend(facts)
    result.notes.extend(notes)
    result.changes.extend(compare_known_issues(b, n))
    return result
