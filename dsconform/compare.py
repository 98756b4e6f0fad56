"""Compare two runs' benchmark JSON (before and after an upgrade, or two nodes).

Direction-aware: each metric says which way is better (``extra_info.better``), so GB/s going up
is an improvement and seconds going up a regression. Noise-aware: a change counts only when it
exceeds both the relative threshold and three times the relative spread of the samples
(stddev / median, the larger of the two runs). A value that crosses the limit the suite enforced
is a regression whatever its size. Outcomes are compared too: a test that passed before and
fails, errors or is skipped now is a regression ("1-bit Adam passed on 0.19.6 and is skipped on
0.19.8"); one that failed before and passes now is an improvement.

Exit codes (CLI): 0 no regression, 1 regression found, 2 unreadable input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GOOD = ("passed", "xfailed")
BAD = ("failed", "error", "xpassed")


class CompareInputError(ValueError):
    """A file that is not a benchmark JSON of this suite (or pytest-benchmark)."""


@dataclass(frozen=True)
class Change:
    kind: str  # "regression" | "improvement" | "unchanged" | "not comparable" | "new" | "gone"
    name: str
    detail: str


@dataclass
class RunComparison:
    changes: list[Change] = field(default_factory=list)

    def of(self, kind: str) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def regressed(self) -> bool:
        return bool(self.of("regression"))


def load(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CompareInputError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise CompareInputError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise CompareInputError(f"{path}: not a benchmark JSON (no 'benchmarks' list)")
    for i, b in enumerate(doc["benchmarks"]):
        if not isinstance(b, dict) or "fullname" not in b or "median" not in b.get("stats", {}):
            raise CompareInputError(f"{path}: benchmarks[{i}]: needs 'fullname' and "
                                    "'stats.median'")
    return doc


def _spread(stats: dict[str, Any]) -> float:
    med = abs(stats.get("median") or 0.0)
    if not med or (stats.get("rounds") or 1) < 2:
        return 0.0
    return (stats.get("stddev") or 0.0) / med


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def compare_metric(name: str, base: dict, new: dict, threshold: float) -> Change:
    info, b_stats, n_stats = new.get("extra_info") or {}, base["stats"], new["stats"]
    better = info.get("better") or (base.get("extra_info") or {}).get("better")
    unit = info.get("unit", "s")
    b, n = float(b_stats["median"]), float(n_stats["median"])
    b_params = (base.get("extra_info") or {}).get("params")
    n_params = info.get("params")
    if b_params != n_params:
        return Change("not comparable", name, f"parameters differ: {b_params} -> {n_params}")
    if better not in ("lower", "higher"):
        # Plain pytest-benchmark entries are timings: lower is better.
        better = "lower"
    limit = info.get("limit")
    where = f"{_fmt(b)} -> {_fmt(n)} {unit}"
    if limit is not None:
        crossed = n < limit if better == "higher" else n > limit
        if crossed:
            return Change("regression", name, f"{where}: beyond the limit {_fmt(limit)} {unit}")
    if b == n:
        return Change("unchanged", name, where)
    rel = (n - b) / abs(b) if b else math.copysign(math.inf, n - b)
    noise = 3 * max(_spread(b_stats), _spread(n_stats))
    if abs(rel) <= max(threshold, noise):
        return Change("unchanged", name, f"{where} ({rel:+.1%}, within "
                                         f"{max(threshold, noise):.1%})")
    worse = rel > 0 if better == "lower" else rel < 0
    pct = f"{rel:+.1%}" if math.isfinite(rel) else "from 0"
    return Change("regression" if worse else "improvement", name,
                  f"{where} ({pct}, {better} is better)")


def _outcomes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["nodeid"]: o for o in (doc.get("dsconform") or {}).get("outcomes", [])}


def compare_outcomes(base: dict, new: dict) -> list[Change]:
    out = []
    b_out, n_out = _outcomes(base), _outcomes(new)
    for nodeid in sorted(set(b_out) | set(n_out)):
        bo, no = b_out.get(nodeid), n_out.get(nodeid)
        if bo is None:
            out.append(Change("new", nodeid, f"{no['outcome']} {no.get('reason', '')}".strip()))
            continue
        if no is None:
            out.append(Change("gone", nodeid, f"was {bo['outcome']}"))
            continue
        b, n = bo["outcome"], no["outcome"]
        if b == n:
            continue
        why = f"{b} -> {n}" + (f": {no['reason']}" if no.get("reason") else "")
        if b in GOOD and n not in GOOD:
            out.append(Change("regression", nodeid, why))
        elif n in GOOD and b in BAD + ("skipped",):
            out.append(Change("improvement", nodeid, why))
        else:
            out.append(Change("not comparable", nodeid, why))
    return out


def compare(base: dict[str, Any], new: dict[str, Any], threshold: float = 0.10) -> RunComparison:
    result = RunComparison()
    b_by = {b["fullname"]: b for b in base["benchmarks"]}
    n_by = {b["fullname"]: b for b in new["benchmarks"]}
    for name in sorted(set(b_by) | set(n_by)):
        if name not in b_by:
            result.changes.append(Change("new", name, f"{_fmt(n_by[name]['stats']['median'])}"))
        elif name not in n_by:
            result.changes.append(Change("gone", name, "no longer measured"))
        else:
            result.changes.append(compare_metric(name, b_by[name], n_by[name], threshold))
    result.changes.extend(compare_outcomes(base, new))
    return result


def _environment(doc: dict[str, Any]) -> str:
    mi = doc.get("machine_info") or {}
    return (f"deepspeed {mi.get('deepspeed', '?')}, torch {mi.get('torch', '?')}, "
            f"{mi.get('gpu_count', '?')}x {mi.get('gpu_model') or 'no GPU'}, "
            f"profile {mi.get('profile', '?')}")


def report(result: RunComparison, base: dict, new: dict) -> list[str]:
    lines = [f"base: {_environment(base)}", f"new:  {_environment(new)}"]
    for kind in ("regression", "improvement", "not comparable", "new", "gone"):
        items = result.of(kind)
        if items:
            lines.append(f"{kind} ({len(items)}):")
            lines.extend(f"  {c.name}: {c.detail}" for c in items)
    lines.append(f"unchanged: {len(result.of('unchanged'))}")
    lines.append("REGRESSION" if result.regressed else "no regression")
    return lines
