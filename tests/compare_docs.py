"""Crafted results documents for the compare tests, written by the real records module (the
format the plugin writes), so only the numbers and outcomes are made up."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsconform.results import records

H200 = {"deepspeed": "0.19.6", "torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9",
        "driver": "580.159.04", "gpu_model": "NVIDIA H200", "gpu_count": 2, "profile": "h200-x2",
        "python_version": "3.12.3", "node": "vm"}
ISSUE = {"id": "DS-1-BROKEN", "title": "stage-0 fp16 unscaled", "link": "https://x/1",
         "deepspeed": ">=0.19.6,<=0.19.8"}


def metric(name: str, samples: Sequence[float], unit: str = "s", better: str = "lower",
           limit: float | None = None, test: str = "t.py::test_m", **params: Any
           ) -> records.Metric:
    return records.Metric(test, name, list(samples), unit, better, limit, params, "c")


def rate(name: str, seconds: Sequence[float], amount: float, floor: float | None = None,
         test: str = "t.py::test_bw", **params: Any) -> records.Metric:
    """As ``metrics.record_rate`` records it: seconds in stats, GB/s in extra_info.rate."""
    r = records.Rate(unit="GB/s", amount=amount, scale=1e9, limit=floor)
    return records.Metric(test, name, list(seconds), "s", "lower", None,
                          {**params, "amount": amount}, "c", r)


def outcome(nodeid: str, result: str, reason: str = "", must: str = "",
            known_issue: str = "") -> records.Outcome:
    return records.Outcome(nodeid, result, "c", reason, 0.1, must, known_issue)


def doc(metrics: Sequence[records.Metric] = (), outcomes: Sequence[records.Outcome] = (),
        facts: Sequence[records.Fact] = (), known_issues: Sequence[dict] = (),
        with_facts: bool = True, **machine: Any) -> dict[str, Any]:
    d = records.document(metrics, outcomes, machine_info={**H200, **machine}, commit_info={},
                         profile={"name": machine.get("profile", "h200-x2")},
                         known_issues=known_issues, facts=facts)
    if not with_facts:  # a file written before facts were recorded
        del d["dsconform"]["facts"]
    # What compare reads is what a file holds: JSON, with tuples as lists.
    return json.loads(json.dumps(d))


def write(path: Path, d: dict[str, Any]) -> str:
    path.write_text(json.dumps(d))
    return str(path)
