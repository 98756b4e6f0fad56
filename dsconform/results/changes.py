"""The vocabulary of a comparison of two runs (dsconform/results/compare.py): what kind of
change, what it is about, and one ``Change`` per difference found."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Change kinds. Only REGRESSION makes the comparison fail.
REGRESSION, IMPROVEMENT, CHANGED, UNCHANGED = "regression", "improvement", "changed", "unchanged"
NOT_COMPARABLE, NEW, VANISHED, RENAMED = "not comparable", "new", "vanished", "renamed"
NOT_JUDGED = "not judged"  # reported, never a regression (noise.not_judged says why)
# What a change is about.
METRIC, OUTCOME, FACT, KNOWN_ISSUE = "metric", "outcome", "fact", "known issue"


@dataclass(frozen=True)
class Change:
    kind: str  # REGRESSION, IMPROVEMENT, CHANGED, UNCHANGED, NOT_COMPARABLE, NEW, VANISHED, ...
    name: str  # the stable id (and metric or fact name), or a known issue's id
    detail: str
    area: str = METRIC  # METRIC, OUTCOME, FACT, KNOWN_ISSUE
    base: str = ""  # the base value or outcome as shown ("300 GB/s", "passed"), on one line
    new: str = ""
    # Metrics: relative change of the value, the noise band it was held to, and its direction.
    rel: float | None = None
    band: float | None = None
    better: str = ""
    noise_known: bool = True
    change: str = ""  # the relative change as shown: "+12.3%", "from 0", "to inf"
    beyond: str = ""  # "beyond its floor 299 GB/s": the enforced limit it crossed
    bound: float | None = None  # a bounded value's bound (then ``band`` is its headroom)
    # Facts: the values themselves, for the JSON output (``base``/``new`` may summarise them).
    base_value: Any = field(default=None, compare=False)
    new_value: Any = field(default=None, compare=False)
