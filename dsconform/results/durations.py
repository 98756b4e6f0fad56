"""What each test took in the last run, from its journal in --results: ``records.previous.jsonl``,
where this run set the last run's ``records.jsonl`` aside (dsconform.results.run_files).

The plugin reads it at configure, so that a cell batch starts the cells that took longest last
time first (dsconform.plugin.batch.cost). A batched cell's own call seconds (``batch_seconds``)
count over its test's duration, which only waited for that call. A test that was skipped, or is
absent, has no recorded duration: the batch then uses a neutral default.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsconform.results.format import RECORDS_JSONL, previous_name

#: A batched cell's call seconds, as a test's user property (junit.xml) and journal field.
BATCH_SECONDS = "dsconform_batch_seconds"
#: Outcomes whose duration says nothing about what the test costs when it runs.
_NOT_RUN = frozenset({"skipped"})


def seconds_by_test(entries: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Each test's seconds (node id -> seconds) from journal entries: its batched call's
    seconds where it has them, else its duration; skipped tests are left out."""
    found: dict[str, float] = {}
    for entry in entries:
        outcome = entry.get("outcome")
        if not isinstance(outcome, dict) or outcome.get("outcome") in _NOT_RUN:
            continue
        seconds = entry.get("batch_seconds", outcome.get("duration_s"))
        if isinstance(seconds, (int, float)) and seconds >= 0 and outcome.get("nodeid"):
            found[str(outcome["nodeid"])] = float(seconds)
    return found


def last_run_seconds(results: Path | None) -> dict[str, float]:
    """``seconds_by_test`` of the last run's journal, set aside in the results folder; empty
    where there is none or it cannot be read (a partial last line, from a run that was killed,
    is skipped)."""
    if results is None:
        return {}
    try:
        lines = (Path(results) / previous_name(RECORDS_JSONL)).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return seconds_by_test(e for e in entries if isinstance(e, dict))
